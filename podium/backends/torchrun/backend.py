"""``TorchrunBackend``: groups of workers started by torchrun, through torchx.

Start-up of one group, in order:

1. check the pool's shape (torchrun: the same process count on every node);
2. bind the group's CURVE-secured control socket and make its keys;
3. submit a torchx app (``local_cwd`` unless ``scheduler`` says otherwise)
   whose role runs torchrun, which runs podium's worker entry point;
4. wait while the scheduler queues the job (``queue_timeout``: then
   ``ResourceUnavailableError`` with the partition and the request), then for
   every rank to connect (``start_timeout``), then send the worker class and
   wait for every constructor. Any failure tears down what was started and
   raises; a job that ended early is a ``WorkerStartupError`` with its id and
   the end of its log.

On a scheduler whose nodes are other hosts (``slurm``, ``kubernetes``), the
workers learn the controller's address from the job's environment
(``controller_host``, default: this host's address as other hosts see it);
their CURVE keys never travel that way (see ``key_dir``).

Memory: with ``tune_malloc`` (the default) the backend raises glibc's
mmap/trim thresholds in the controller process once, when it is created, so
that large tensors made per call reuse heap pages instead of page-faulting a
fresh ``mmap`` each time (see :func:`.shm.tune_malloc`). Freed memory then
stays in the process's heap (RSS does not shrink); pass
``backend_options={'tune_malloc': False}`` to keep glibc's defaults.

Logs: on a local scheduler each group gives torchx a log directory of its own
(unless ``scheduler_cfg`` names one), removed when the group shuts down; a
group whose processes failed keeps it, and podium logs where it is.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from podium.backends.torchrun.group import TorchrunGroup
from podium.backends.torchrun.launch import (
    app_for_pool,
    check_pool_shape,
    dryrun,
    free_port,
    make_runner,
)
from podium.backends.torchrun.schedulers import job_id, queue_detail, reachable_host
from podium.backends.torchrun.shm import tune_malloc
from podium.core.backend import Backend, BackendGroup, BackendOption, Capabilities, GroupSpec
from podium.core.resource import ResourcePool
from podium.errors import ResourceUnavailableError, WorkerDiedError, WorkerStartupError

__all__ = ["TorchrunBackend"]

log = logging.getLogger("podium.torchrun")

_LOCAL_SCHEDULERS = ("local_cwd", "local_docker", "local")
# Schedulers whose nodes all share this host's network (local_docker gives each its own).
_LOOPBACK_SCHEDULERS = ("local_cwd", "local")
_TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
# States of an app the scheduler has not started yet.
_QUEUED = ("UNSUBMITTED", "SUBMITTED", "PENDING")


class TorchrunBackend(Backend):
    """Workers launched by torchrun through a torchx scheduler, driven over ZeroMQ."""

    name: ClassVar[str] = "torchrun"
    capabilities: ClassVar[Capabilities] = Capabilities(
        process_group=True,
        multi_node=True,
        gpu=True,
        fractional_colocation=True,
        named_workers=False,
        worker_to_worker_futures=False,
        call_timeout=True,
        cancels_timed_out_calls=True,
        detects_dead_workers=True,
        worker_env=True,
        batch_refs=True,
        concurrent_async_calls=True,
    )
    options: ClassVar[Sequence[BackendOption]] = (
        BackendOption(
            "scheduler", str, "local_cwd", "torchx scheduler: local_cwd, slurm, kubernetes, ..."
        ),
        BackendOption(
            "scheduler_cfg",
            dict,
            None,
            "the torchx scheduler's run config (e.g. {'partition': 'gpu'})",
        ),
        BackendOption(
            "controller_host",
            str,
            None,
            "address workers use to reach the controller (default: 127.0.0.1 on local schedulers; "
            "on others this host's address as other hosts see it: its name's address, else the "
            "outward interface's)",
        ),
        BackendOption(
            "bind_host", str, None, "interface the control socket binds (default: controller_host)"
        ),
        BackendOption(
            "data_host",
            str,
            None,
            "address each worker's shard server binds, which serves its output='ref' shards to "
            "readers on other hosts (default: 127.0.0.1 on local schedulers; on others the worker "
            "host's address as other hosts see it; '0.0.0.0': every interface)",
        ),
        BackendOption(
            "shard_network",
            bool,
            False,
            "read BatchRef rows through the producers' shard servers even on the producer's host "
            "(tests and benchmarks of the cross-host path; same-host reads otherwise map shared "
            "memory)",
        ),
        BackendOption(
            "key_dir",
            str,
            None,
            "directory in which each group leaves its ranks' CURVE keys (a 0700 subdirectory, one "
            "0600 file per rank, deleted by the rank when it starts); every worker node must see it "
            "under the same path, as the same user. Default: the system temp dir on local schedulers, "
            "the current working directory (a shared filesystem, as Slurm jobs assume) on others",
        ),
        BackendOption(
            "start_timeout", (int, float), 180.0, "seconds to wait for every worker to start"
        ),
        BackendOption(
            "queue_timeout",
            (int, float),
            None,
            "seconds the scheduler may keep the job queued (pending) before start-up fails with "
            "ResourceUnavailableError naming the partition and the request (default: start_timeout); "
            "start_timeout counts from when the job leaves the queue",
        ),
        BackendOption(
            "heartbeat_timeout",
            (int, float),
            4.0,
            "seconds without a worker heartbeat before it is declared dead",
        ),
        BackendOption(
            "orphan_timeout",
            (int, float),
            8.0,
            "seconds without word from the controller and without a live connection to it before "
            "workers exit. On the controller's host they exit as soon as its process has exited and "
            "wait while it is paused; elsewhere a busy controller keeps its connection (ZMTP "
            "heartbeats need no GIL), and one whose connection goes silent (host lost, or the whole "
            "process stopped) counts as gone after this long",
        ),
        BackendOption(
            "forward_output", bool, True, "print workers' stdout/stderr here with a rank prefix"
        ),
        BackendOption(
            "python", str, None, "Python interpreter on the worker hosts (default: this one)"
        ),
        BackendOption(
            "image",
            str,
            None,
            "container image the workers run in on container schedulers (kubernetes, "
            "local_docker): one with podium, torch and your code installed; set 'python' to its "
            "interpreter. Default '.': this directory, as local_cwd and slurm use it",
        ),
        BackendOption(
            "mounts",
            list,
            None,
            "torchx mounts for every node, one string each (e.g. 'type=volume,src=my-claim,"
            "dst=/shared' on Kubernetes); key_dir must be on a path every worker sees",
        ),
        BackendOption(
            "cpu_per_node",
            int,
            None,
            "CPUs each node asks the scheduler for (default: nproc_per_node)",
        ),
        BackendOption(
            "mem_mb_per_node",
            int,
            None,
            "memory (MB) each node asks for (default: 1024 per process)",
        ),
        BackendOption(
            "tune_malloc",
            bool,
            True,
            "raise glibc's mmap/trim thresholds in this (the controller's) process when the backend "
            "starts, so large tensors made per call (the concatenated result of a DP call) reuse heap "
            "pages instead of page-faulting a fresh mmap each time (~6x faster for 64 MiB). Trade-off: "
            "memory this process frees stays in its heap for reuse, so RSS stays at its high-water mark. "
            "Worker processes always do this.",
        ),
        BackendOption(
            "shutdown_timeout",
            (int, float),
            10.0,
            "seconds each worker may take to run its shutdown() hook and exit when the group stops, "
            "before it is killed",
        ),
        BackendOption(
            "shm_keep_mb",
            (int, float),
            256,
            "free shared memory (MiB) each process keeps for reuse, or, if more, what it had in "
            "use at once at its peak within shm_keep_s; the oldest beyond that is removed",
        ),
        BackendOption(
            "shm_keep_s",
            (int, float),
            30.0,
            "seconds an unused shared-memory segment is kept for reuse before it is removed",
        ),
        BackendOption(
            "rdzv_port",
            int,
            None,
            "rendezvous store port on rank 0's host (multi-node; default: a free port on local "
            "schedulers, 29500 on others)",
        ),
    )

    @classmethod
    def describe_environment(cls) -> list[str]:
        """Which torchx schedulers can run workers from this host (``scheduler=`` values)."""
        from podium.backends.torchrun.schedulers import scheduler_report

        lines = ["torchx schedulers (backend_options={'scheduler': ...}):"]
        for name, usable, why in scheduler_report():
            lines.append(f"  {name:<16} {'usable' if usable else 'not usable':<10}  {why}")
        return lines

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        if self.config["tune_malloc"]:
            tune_malloc()
        self._runner: Any = None
        self._runner_lock = threading.Lock()
        self._groups: list[TorchrunGroup] = []
        # Groups running on each pool (colocation), kept as long as the pool is.
        self._pool_groups: weakref.WeakKeyDictionary[ResourcePool, list[TorchrunGroup]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def scheduler(self) -> str:
        return str(self.config["scheduler"])

    def runner(self) -> Any:
        with self._runner_lock:
            if self._runner is None:
                self._runner = make_runner()
            return self._runner

    # -- resources ------------------------------------------------------------

    def check_resources(self, pools: Sequence[ResourcePool]) -> None:
        for pool in pools:
            check_pool_shape(pool)
        if self.scheduler not in _LOCAL_SCHEDULERS:
            return  # a remote scheduler queues what it cannot place now; it answers for itself
        gpu_pools = [p for p in pools if p.use_gpu]
        if not gpu_pools:
            return  # CPU workers on one host may be oversubscribed
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = max(max(p.process_on_nodes) for p in gpu_pools)
        if need > have:
            raise ResourceUnavailableError(
                f"a GPU pool needs {need} GPUs per node but this host has {have}. Use "
                "ResourcePool(..., use_gpu=False) for CPU workers, a smaller pool, or a scheduler "
                "with GPU nodes (backend_options={'scheduler': 'slurm', ...}).",
                demand={"gpus_per_node": need},
                supply={"gpus": have},
            )

    def app_for(self, spec: GroupSpec, env: Mapping[str, str]) -> Any:
        """The torchx AppDef for ``spec`` (public so a dry run can show it)."""
        nnodes, nproc = check_pool_shape(spec.pool)
        port = self.config["rdzv_port"]
        if port is None and nnodes > 1:
            port = free_port() if self.scheduler in _LOCAL_SCHEDULERS else 29500
        return app_for_pool(
            spec.pool,
            name=_app_name(spec.name_prefix),
            env=env,
            python=self.config["python"],
            rdzv_port=port,
            cpu=self.config["cpu_per_node"] or nproc,
            mem_mb=self.config["mem_mb_per_node"] or 1024 * nproc,
            local=self.scheduler in _LOOPBACK_SCHEDULERS,
            image=self.config["image"],
            mounts=self.config["mounts"] or (),
        )

    def dryrun(self, spec: GroupSpec) -> Any:
        """What torchx would submit for ``spec``, without starting anything (a ``AppDryRunInfo``)."""
        check_pool_shape(spec.pool)
        env = dict(spec.worker_env)
        env.update({"PODIUM_TR_ADDR": "tcp://<controller>:<port>", "PODIUM_TR_GROUP": "dryrun"})
        app = self.app_for(spec, env)
        return dryrun(self.runner(), app, self.scheduler, self.config["scheduler_cfg"] or {})

    # -- groups -----------------------------------------------------------------

    def _start_group(self, spec: GroupSpec) -> BackendGroup:
        check_pool_shape(spec.pool)
        # Groups colocated on one pool share its slots (and GPUs); at most max_colocate_count.
        live = [g for g in self._pool_groups.get(spec.pool, []) if g in self._groups]
        if len(live) >= spec.pool.max_colocate_count:
            raise ResourceUnavailableError(
                f"pool {spec.pool.name_prefix!r} already holds {len(live)} running group(s) and allows "
                f"{spec.pool.max_colocate_count} (max_colocate_count). Shut one down, or create the pool "
                f"with max_colocate_count={len(live) + 1}.",
                demand=len(live) + 1,
                supply=spec.pool.max_colocate_count,
            )
        key_dir = self.config["key_dir"]
        if key_dir is None and self.scheduler not in _LOCAL_SCHEDULERS:
            key_dir = os.getcwd()
        if key_dir is not None and not os.path.isdir(key_dir):
            raise ValueError(
                f"backend_options['key_dir'] is {key_dir!r}, which is not a directory. Give a "
                "directory that every worker node sees under the same path (a shared filesystem)."
            )
        host = self.config["controller_host"]
        if host is None and self.scheduler not in _LOOPBACK_SCHEDULERS:
            # Workers may run on other hosts; they read the address from the job's environment.
            host = reachable_host()
        data_host = self.config["data_host"]
        if data_host is None and self.scheduler in _LOOPBACK_SCHEDULERS:
            data_host = "127.0.0.1"  # every node is this host: readers are local
        group = TorchrunGroup(
            spec,
            {**self.config, "key_dir": key_dir, "controller_host": host, "data_host": data_host},
        )
        self._pool_groups[spec.pool] = [*live, group]
        group._closer = self._close_group
        runner = self.runner()
        timeout = float(self.config["start_timeout"])
        cfg = dict(self.config["scheduler_cfg"] or {})
        try:
            local = self.scheduler in _LOCAL_SCHEDULERS
            if (
                local
                and "log_dir" not in cfg
                and runner.scheduler_run_opts(self.scheduler).get("log_dir")
            ):
                # Without one, torchx makes a /tmp/torchx_* directory per start
                # and removes only the last when the runner closes.
                group.log_dir = cfg["log_dir"] = tempfile.mkdtemp(prefix="podium-torchx-")
            app = self.app_for(spec, group.worker_env())
            info = dryrun(runner, app, self.scheduler, cfg)
            handle = group.app_handle = runner.schedule(info)
            self._groups.append(group)
            job = f"{self.scheduler} job {job_id(handle)}"
            queue_timeout = self.config["queue_timeout"]
            queue_limit = float(timeout if queue_timeout is None else queue_timeout)
            submitted = time.monotonic()

            def ended() -> str | None:
                try:
                    status = runner.status(handle)
                except Exception as exc:  # e.g. sacct failing once under load: ask again later
                    log.debug("status of %s failed: %s", job, exc)
                    return None
                state = status.state.name if status is not None else None
                # Unknown (None) right after submission: the scheduler has not listed it yet.
                group.queued = state is None or state in _QUEUED
                if group.queued and time.monotonic() - submitted > queue_limit:
                    raise self._queued_error(spec, job, handle, cfg, queue_limit)
                if state in _TERMINAL:
                    msg = f": {status.msg}" if status is not None and status.msg else ""
                    text = f"{job}: state {state}{msg}"
                    group.scheduler_log = _agent_log_tail(runner, handle)
                    return text
                return None

            group.wait_started(ended, timeout)
            group.init_workers(timeout)
        except BaseException as exc:
            if isinstance(exc, (WorkerStartupError, WorkerDiedError)):
                group.keep_logs = True
            group.shutdown()
            raise
        return group

    def _close_group(self, group: TorchrunGroup) -> None:
        if group._dead is not None:  # a worker died before shutdown: keep what it wrote
            group.keep_logs = True
        # Pending calls fail at once; each worker runs its shutdown() hook and
        # exits (killed by its supervisor past the grace), then torchrun ends.
        grace = float(self.config["shutdown_timeout"])
        group.stop_workers(grace + 2.0, grace=grace)
        handle = group.app_handle
        if handle is not None:
            runner = self.runner()
            # A job no rank reached (still queued, or failed) has nothing to wait for.
            deadline = time.monotonic() + (5.0 if group.any_connected() else 0.0)
            state = None
            while time.monotonic() < deadline:
                try:
                    status = runner.status(handle)
                except Exception:
                    break
                state = status.state.name if status is not None else None
                if state in _TERMINAL or status is None:
                    break
                time.sleep(0.05)
            if state not in _TERMINAL:
                try:
                    runner.cancel(handle)
                except Exception:
                    pass
        group.close_channel()
        if group in self._groups:
            self._groups.remove(group)
        if group.log_dir is not None:
            if group.keep_logs:
                log.warning(
                    "group %r failed; the scheduler's logs of its processes are kept in %s",
                    group.spec.name_prefix,
                    group.log_dir,
                )
            else:
                shutil.rmtree(group.log_dir, ignore_errors=True)

    def _queued_error(
        self, spec: GroupSpec, job: str, handle: str, cfg: Mapping[str, Any], waited: float
    ) -> ResourceUnavailableError:
        nnodes, nproc = check_pool_shape(spec.pool)
        request = {
            "nodes": nnodes,
            "cpus_per_node": self.config["cpu_per_node"] or nproc,
            "mem_mb_per_node": self.config["mem_mb_per_node"] or 1024 * nproc,
            "gpus_per_node": nproc if spec.pool.use_gpu else 0,
        }
        detail = queue_detail(self.scheduler, job_id(handle))
        partition = detail.get("partition") or cfg.get("partition") or "the default partition"
        asked = ", ".join(f"{k}={v}" for k, v in request.items())
        reason = f" (scheduler's reason: {detail['reason']})" if detail.get("reason") else ""
        return ResourceUnavailableError(
            f"{job} for group {spec.name_prefix!r} stayed queued in partition {partition!r} for "
            f"{waited:g} s{reason}; it asks for {asked}. Ask for less (a smaller pool, "
            "backend_options['cpu_per_node'] / ['mem_mb_per_node']), pick another partition "
            "(scheduler_cfg={'partition': ...}), or wait longer (backend_options['queue_timeout']).",
            demand=request,
            supply={"partition": partition, **detail},
        )

    def _shutdown(self) -> None:
        for group in list(self._groups):
            group.shutdown()
        if self._runner is not None:
            self._runner.close()
            self._runner = None


def _app_name(prefix: str) -> str:
    clean = "".join(c if c.isalnum() or c in "-_" else "-" for c in prefix).strip("-_") or "podium"
    return f"podium-{clean}"[:40]


def _agent_log_tail(runner: Any, handle: Any, lines: int = 20) -> str:
    """What node 0's torchrun agent printed, when the scheduler keeps it (best effort).

    The first traceback a worker process printed (the cause: torchrun's own
    failure box at the end only gives an exit code), then the last ``lines``.
    """
    from podium.backends.torchrun.launch import ROLE_NAME

    try:
        log = [line.rstrip("\n") for line in runner.log_lines(handle, ROLE_NAME, 0)]
    except Exception:  # schedulers without logs, or logs already gone
        return ""
    tail = log[-lines:]
    cause = _first_traceback(log[: len(log) - len(tail)])
    if cause:
        tail = [*cause, "...", *tail]
    return "\n".join(tail).rstrip()


def _first_traceback(log: list[str], most: int = 60) -> list[str]:
    """The first Python traceback in ``log`` that is not torchrun's own (at most ``most`` lines)."""
    i = 0
    while i < len(log):
        if log[i].lstrip().startswith("Traceback (most recent call last):"):
            end = i + 1
            while end < len(log) and (log[end].startswith((" ", "\t")) or not log[end].strip()):
                end += 1
            if end < len(log) and "torch.distributed.elastic" not in log[end]:
                block = log[i : end + 1]
                return block if len(block) <= most else [block[0], "...", *block[-most:]]
            i = end
        i += 1
    return []
