"""Failures: a worker killed mid-call, a controller killed, bad pools, and a Slurm dry run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from podium import ClassWithInitArgs, ResourcePool, Worker, WorkerGroup, get, load_backend, register
from podium.core.backend import GroupSpec
from podium.core.decorator import Dispatch
from podium.errors import ResourceUnavailableError, WorkerDiedError


class SlowWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def slow(self, seconds: float) -> int:
        print(f"rank {self.rank} starts a slow call", flush=True)
        time.sleep(seconds)
        return self.rank


@pytest.mark.timeout(120)
def test_worker_sigkilled_mid_call(procs) -> None:
    wg = WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(SlowWorker), backend="torchrun"
    )
    gid = wg._group.gid
    try:
        pids = wg.pid()
        futures = wg.slow(60)
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            get(futures, timeout=30)
        assert time.monotonic() - start < 5
        err = info.value
        assert err.rank == 1 and err.signal == signal.SIGKILL
        assert "rank 1 starts a slow call" in err.log_tail
        # later calls fail fast
        start = time.monotonic()
        with pytest.raises(WorkerDiedError):
            wg.pid()
        assert time.monotonic() - start < 1
    finally:
        wg.shutdown()
    assert procs.wait_gone(gid, 10) == []


CONTROLLER = textwrap.dedent(
    """
    import os, sys, time
    from podium import ClassWithInitArgs, ResourcePool, Worker, WorkerGroup, register
    from podium.core.decorator import Dispatch

    class W(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def pid(self):
            return os.getpid()

    wg = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(W), backend="torchrun")
    print("GROUP", wg._group.gid, wg._group.channel.ipc_address, *wg.pid(), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(120)
def test_controller_sigkilled_leaves_no_workers(tmp_path, procs) -> None:
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("GROUP"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"controller exited early with {proc.returncode}")
        _, gid, ipc, *pids = line.split()
        assert len(procs.find(gid)) >= 5  # an agent, 2 supervisors, 2 workers
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic()
        left = procs.wait_gone(gid, 15)
        assert left == [], f"still running 15 s after the controller died: {left}"
        assert time.monotonic() - killed_at < 15
        # Rank 0's supervisor removed what the controller could not: its Unix socket too.
        assert not os.path.exists(os.path.dirname(ipc[len("ipc://") :]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_unequal_node_entries_are_refused() -> None:
    backend = load_backend("torchrun")
    pool = ResourcePool([2, 1], use_gpu=False)
    with pytest.raises(ValueError, match=r"same number of processes on every node.*\[2, 1\]"):
        backend.check_resources([pool])
    with pytest.raises(ValueError, match="same number of processes"):
        WorkerGroup(pool, ClassWithInitArgs(SlowWorker), backend=backend)


@pytest.mark.timeout(60)
def test_a_gpu_pool_on_a_host_without_enough_gpus_starts_nothing() -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = load_backend("torchrun")
    start = time.monotonic()
    with pytest.raises(ResourceUnavailableError, match=f"needs {have + 2} GPUs per node"):
        WorkerGroup(
            ResourcePool([have + 2], use_gpu=True), ClassWithInitArgs(SlowWorker), backend=backend
        )
    assert time.monotonic() - start < 10  # refused before any process started
    assert backend._groups == []  # type: ignore[attr-defined]


def test_unknown_option_is_an_error() -> None:
    with pytest.raises(ValueError, match="did you mean 'scheduler'"):
        load_backend("torchrun", schedular="slurm")


def test_slurm_dry_run_for_two_gpu_nodes() -> None:
    backend = load_backend("torchrun", scheduler="slurm", scheduler_cfg={"partition": "gpu"})
    spec = GroupSpec(
        pool=ResourcePool([4, 4], use_gpu=True),
        cls_with_init=ClassWithInitArgs(SlowWorker),
        name_prefix="train",
    )
    script = backend.dryrun(spec).request.materialize()
    headers = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    jobs = [h for h in headers if "--job-name" in h]
    assert len(jobs) == 2  # two nodes (one het-job component each)
    for job in jobs:
        assert (
            "--ntasks-per-node=1" in job and "--gpus-per-task=4" in job and "--partition=gpu" in job
        )
    assert script.count("--nnodes 2 --nproc-per-node 4") == 2
    assert script.count("--no-python") == 2 and script.count("worker.py") == 2
    # podium's static rendezvous (nothing unpickled), node ranks from the replica ids
    assert script.count("--rdzv-backend podium-static") == 2 and "c10d" not in script
    assert "--rdzv-conf rank=0" in script and "--rdzv-conf rank=1" in script
    assert "GLOO_SOCKET_IFNAME" not in script  # multi-node: torch.distributed uses the network


@pytest.mark.timeout(120)
def test_an_agent_that_cannot_start_is_reported_with_its_output() -> None:
    from podium.errors import WorkerStartupError

    with pytest.raises(WorkerStartupError) as info:
        WorkerGroup(
            ResourcePool([1], use_gpu=False),
            ClassWithInitArgs(SlowWorker),
            backend="torchrun",
            backend_options={"python": "/nonexistent/podium-python"},
        )
    text = str(info.value)
    assert "ended before every worker connected" in text
    assert "/nonexistent/podium-python" in text  # the agent's own output names the problem


@pytest.mark.timeout(120)
def test_a_group_removes_its_scheduler_logs_at_shutdown(monkeypatch, tmp_path) -> None:
    import tempfile

    from podium.backends.torchrun.backend import TorchrunBackend

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where torchx would make its own
    backend = TorchrunBackend(forward_output=False)
    try:
        log_dirs = []
        for _ in range(2):
            wg = WorkerGroup(
                ResourcePool([1], use_gpu=False), ClassWithInitArgs(SlowWorker), backend=backend
            )
            log_dirs.append(getattr(wg._group, "log_dir", None))
            wg.shutdown()
        assert [p for p in os.listdir(tmp_path) if p.startswith("torchx_")] == []
        assert all(d and d.startswith(str(tmp_path)) and not os.path.exists(d) for d in log_dirs)
    finally:
        backend.shutdown()


@pytest.mark.timeout(120)
def test_a_group_that_failed_keeps_its_scheduler_logs_and_says_where(
    monkeypatch, tmp_path, caplog
) -> None:
    import tempfile

    from podium.backends.torchrun.backend import TorchrunBackend
    from podium.errors import WorkerStartupError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    caplog.set_level("WARNING", logger="podium.torchrun")
    backend = TorchrunBackend(python="/nonexistent/podium-python", forward_output=False)
    try:
        with pytest.raises(WorkerStartupError):
            WorkerGroup(
                ResourcePool([1], use_gpu=False), ClassWithInitArgs(SlowWorker), backend=backend
            )
        kept = [
            os.path.join(tmp_path, p)
            for p in os.listdir(tmp_path)
            if p.startswith("podium-torchx-")
        ]
        assert len(kept) == 1 and os.path.isdir(kept[0])
        assert any(kept[0] in r.getMessage() for r in caplog.records)
    finally:
        backend.shutdown()
