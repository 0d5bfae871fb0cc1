"""What the torchrun backend needs to know about torchx schedulers beyond torchx's API.

- which schedulers are usable on this host (``podium backends`` prints it);
- the address by which workers on other hosts reach this controller;
- why a queued job waits (Slurm: ``squeue``'s partition and reason), so a job
  that never starts is reported with what it asked for and where.

Every check here is best effort and bounded in time: a missing command or a
scheduler that does not answer is a reason printed, never a hang.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
from typing import Any

__all__ = ["job_id", "queue_detail", "reachable_host", "scheduler_report"]

_TIMEOUT = 5.0


def job_id(handle: str) -> str:
    """The scheduler's id of the app ``handle`` (``slurm://session/1234`` -> ``1234``)."""
    return handle.rstrip("/").rsplit("/", 1)[-1]


def reachable_host() -> str:
    """This host's address as other hosts see it (``127.0.0.1`` when it has no other).

    The host name's address when it is not a loopback one, else the address of
    the interface that routes outwards (a UDP ``connect`` sends nothing).
    """
    try:
        addr = socket.gethostbyname(socket.getfqdn())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    for probe in ("10.255.255.255", "192.0.2.255"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if not addr.startswith(("127.", "0.")):
            return str(addr)
    return "127.0.0.1"


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def queue_detail(scheduler: str, app_id: str) -> dict[str, str]:
    """Where and why the scheduler keeps ``app_id`` queued (Slurm: partition, reason), if it says."""
    if scheduler != "slurm":
        return {}
    proc = _run(["squeue", "-h", "-j", app_id, "-o", "%P|%r"])
    if proc is None or proc.returncode != 0 or "|" not in proc.stdout:
        return {}
    partition, _, reason = proc.stdout.strip().splitlines()[0].partition("|")
    return {"partition": partition, "reason": reason}


def _slurm() -> tuple[bool, str]:
    missing = [
        c for c in ("sbatch", "sacct", "squeue", "scancel", "sinfo") if shutil.which(c) is None
    ]
    if missing:
        return False, f"Slurm commands not found: {', '.join(missing)}"
    proc = _run(["sinfo", "-h", "-o", "%P %a %D %T"])
    if proc is None or proc.returncode != 0:
        why = (
            proc.stderr.strip().splitlines()[-1]
            if proc is not None and proc.stderr.strip()
            else f"no answer within {_TIMEOUT:g} s"
        )
        return False, f"sinfo failed: {why}"
    acct = _run(["sacct", "-n", "-X", "-S", "now"])
    if acct is None or acct.returncode != 0:
        return (
            False,
            "sacct fails (torchx reads job states from Slurm's accounting: enable slurmdbd)",
        )
    parts = sorted({line.split()[0] for line in proc.stdout.splitlines() if line.strip()})
    return True, "partitions: " + (", ".join(parts) or "none")


def _kubernetes() -> tuple[bool, str]:
    if importlib.util.find_spec("kubernetes") is None:
        return (
            False,
            "the 'kubernetes' Python package is not installed (pip install 'torchx[kubernetes]')",
        )
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True, "in-cluster configuration"
    config = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if not any(os.path.exists(p) for p in config.split(os.pathsep)):
        return False, f"no kubeconfig ({config})"
    return True, f"kubeconfig {config}"


def _docker() -> tuple[bool, str]:
    if importlib.util.find_spec("docker") is None:
        return False, "the 'docker' Python package is not installed"
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return True, f"DOCKER_HOST={host} (the daemon itself is not checked)"
    path = host[len("unix://") :]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(_TIMEOUT)
            s.connect(path)
    except OSError as exc:
        return False, f"no Docker daemon at {path} ({exc.strerror or exc})"
    return True, f"Docker daemon at {path}"


def _needs(module: str) -> tuple[bool, str]:
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing
        found = False
    if not found:
        return False, f"the {module!r} Python package is not installed"
    return True, f"{module} installed (the service itself is not checked)"


_CHECKS: dict[str, Any] = {
    "local_cwd": lambda: (True, "processes on this host"),
    "local_docker": _docker,
    "slurm": _slurm,
    "kubernetes": _kubernetes,
    "kubernetes_mcad": _kubernetes,
    "aws_batch": lambda: _needs("boto3"),
    "aws_sagemaker": lambda: _needs("sagemaker"),
    "gcp_batch": lambda: _needs("google.cloud.batch_v1"),
    "ray": lambda: _needs("ray"),
    "lsf": lambda: (
        shutil.which("bsub") is not None,
        "bsub" + (" found" if shutil.which("bsub") else " not found"),
    ),
}


def scheduler_report() -> list[tuple[str, bool, str]]:
    """``(scheduler, usable here, why)`` for every torchx scheduler installed."""
    from torchx.schedulers import get_scheduler_factories

    rows = []
    for name in get_scheduler_factories():
        check = _CHECKS.get(name)
        if check is None:
            rows.append((name, False, "unknown to podium: not checked"))
            continue
        try:
            usable, why = check()
        except Exception as exc:  # a check must not break the listing
            usable, why = False, f"check failed: {type(exc).__name__}: {exc}"
        rows.append((name, bool(usable), why))
    return rows
