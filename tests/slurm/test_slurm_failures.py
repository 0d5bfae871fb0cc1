"""Slurm job states as podium errors: queued too long, failed before start, cancelled, a rank's exit."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from podium import ClassWithInitArgs, ResourcePool, WorkerGroup, get, load_backend
from podium.errors import ResourceUnavailableError, WorkerDiedError, WorkerStartupError
from podium.testing.conformance.workers import ConformanceWorker

pytestmark = pytest.mark.timeout(180)

SLURM: dict[str, Any] = {"scheduler": "slurm", "scheduler_cfg": {"partition": "debug"}}


def _job_in(text: str) -> str:
    found = re.search(r"slurm job (\d+)", text)
    assert found, text
    return found.group(1)


def _job(wg: WorkerGroup) -> str:
    return str(wg._group.app_handle).rsplit("/", 1)[-1]  # type: ignore[attr-defined]


def test_a_job_queued_past_queue_timeout_is_resource_unavailable(slurm: Any) -> None:
    # The local cluster's `queued` partition is down: its jobs stay pending.
    backend = load_backend(
        "torchrun", scheduler="slurm", scheduler_cfg={"partition": "queued"}, queue_timeout=3
    )
    start = time.monotonic()
    with pytest.raises(ResourceUnavailableError) as info:
        WorkerGroup(
            ResourcePool([2], use_gpu=False), ClassWithInitArgs(ConformanceWorker), backend=backend
        )
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert "partition 'queued'" in text and "PartitionDown" in text
    assert "nodes=1" in text and "cpus_per_node=2" in text and "queue_timeout" in text
    assert info.value.demand["cpus_per_node"] == 2
    assert slurm.wait_gone(_job_in(text), timeout=15)  # the queued job was cancelled


def test_a_job_that_fails_before_its_ranks_connect_is_a_startup_error(slurm: Any) -> None:
    backend = load_backend("torchrun", **SLURM, python="/nonexistent/python3")
    start = time.monotonic()
    with pytest.raises(WorkerStartupError) as info:
        WorkerGroup(
            ResourcePool([2], use_gpu=False), ClassWithInitArgs(ConformanceWorker), backend=backend
        )
    assert time.monotonic() - start < 60
    text = str(info.value)
    assert "state FAILED" in text
    assert "/nonexistent/python3" in info.value.log_tail  # the end of the job's own log
    assert info.value.log_tail in text
    assert slurm.wait_gone(_job_in(text), timeout=15)


def test_scancel_from_outside_is_a_worker_died_error_within_seconds(slurm: Any) -> None:
    wg = WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(ConformanceWorker),
        backend="torchrun",
        backend_options=SLURM,
    )
    try:
        job = _job(wg)
        futures = wg.execute_all_async("sleep", 60)
        time.sleep(0.5)
        start = time.monotonic()
        slurm.run("scancel", job)
        with pytest.raises(WorkerDiedError):
            get(futures, timeout=60)
        assert time.monotonic() - start < 15
        with pytest.raises(WorkerDiedError):
            wg.whoami()
    finally:
        wg.shutdown()
    assert slurm.wait_gone(job, timeout=20)
    assert slurm.state(job) == "CANCELLED"


def test_a_worker_that_exits_non_zero_is_a_worker_died_error(slurm: Any) -> None:
    wg = WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(ConformanceWorker),
        backend="torchrun",
        backend_options=SLURM,
    )
    try:
        job = _job(wg)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            wg.die(on_rank=1, how="exit")
        assert time.monotonic() - start < 15
        assert info.value.rank == 1 and info.value.exit_code == 3
    finally:
        wg.shutdown()
    assert slurm.wait_gone(job, timeout=20)
