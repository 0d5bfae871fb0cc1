"""A real one-node Slurm cluster for the torchrun backend's Slurm tests.

The cluster is started once per test session by ``scripts/local-slurm.sh``
(installing the Debian packages on first use) and stopped at the end, unless
it was already running before the session (then it is someone else's and is
left alone). Where it cannot run (not root, packages missing and no apt-get)
the tests are skipped with the script's reason.

Each test module runs in a directory of its own: Slurm writes job output
(``slurm-<job>-podium-0.err``) and podium its key directories into the
controller's working directory, the shared filesystem a Slurm job assumes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("torchx")
pytest.importorskip("zmq")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "local-slurm.sh"
CANNOT_RUN = 77  # the script's "cannot run here"


class SlurmCluster:
    """The started cluster: its ``SLURM_CONF`` and a few commands the tests use."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def run(self, *cmd: str) -> str:
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, check=True, timeout=30
        ).stdout

    def queue(self) -> list[str]:
        """Ids of the jobs Slurm still holds (pending, running or completing)."""
        return self.run("squeue", "-h", "-o", "%i").split()

    def state(self, job: str) -> str:
        """The job's state as accounting records it (``COMPLETED``, ``CANCELLED``, ...)."""
        for line in self.run("sacct", "-n", "-X", "-P", "-o", "State", "-j", job).splitlines():
            return line.split()[0] if line.strip() else ""
        return ""

    def wait_gone(self, job: str, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if job not in self.queue():
                return True
            time.sleep(0.2)
        return False


_stop: list[Callable[[], None]] = []  # how to stop the cluster this session started


def _stop_cluster() -> None:
    while _stop:
        _stop.pop()()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop the cluster after the last Slurm test, not at the end of the whole session."""
    result = yield
    here = Path(__file__).parent
    if nextitem is None or here not in nextitem.path.parents:
        _stop_cluster()
    return result


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    env = dict(os.environ)
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, env=env)
    if status.returncode == 0:
        started = False  # someone else's cluster: use it, leave it running
    else:
        proc = subprocess.run(
            ["bash", str(SCRIPT), "start"], capture_output=True, text=True, env=env, timeout=600
        )
        if proc.returncode == CANNOT_RUN:
            pytest.skip(f"no local Slurm cluster: {proc.stderr.strip()}")
        started = True
        if proc.returncode != 0:
            subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, env=env, timeout=120)
            pytest.fail(f"scripts/local-slurm.sh start failed:\n{proc.stdout}\n{proc.stderr}")
    directory = env.get("PODIUM_SLURM_DIR", "/tmp/podium-slurm")
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = env["SLURM_CONF"] = f"{directory}/etc/slurm.conf"

    def stop() -> None:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        if started:
            subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, env=env, timeout=120)

    _stop.append(stop)
    try:
        yield SlurmCluster(env)
    finally:
        _stop_cluster()


@pytest.fixture(scope="module", autouse=True)
def job_dir(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This module's working directory, where its jobs' output lands."""
    path = tmp_path_factory.mktemp("slurm-jobs")
    before = os.getcwd()
    os.chdir(path)
    try:
        yield path
    finally:
        os.chdir(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, before their fixtures start anything, the tests a class marks as not run on Slurm.

    A class lists them in ``not_on_slurm``: test name -> reason (each of those
    would submit jobs of its own; the local schedulers run them).
    """
    for item in items:
        skipped = getattr(getattr(item, "cls", None), "not_on_slurm", None)
        if skipped is None:
            continue
        name = getattr(item, "originalname", item.name)
        reason = skipped(name, set(getattr(item, "fixturenames", ())))
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
