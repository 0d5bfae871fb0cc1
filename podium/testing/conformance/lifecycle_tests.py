"""Conformance: lifecycle and contract edges every backend must agree on.

The workers' ``shutdown()`` hook, dropped groups, classes that stay themselves,
timed-out calls, ``sys.exit`` in a worker, one call per rank at a time,
shutdown with calls in flight, values that cannot cross, GPU pools.
"""

from __future__ import annotations

import gc
import importlib
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from podium import (
    CallTimeoutError,
    ClassWithInitArgs,
    RemoteError,
    ResourcePool,
    WorkerDiedError,
    WorkerGroup,
)
from podium.core.backend import Backend
from podium.errors import GroupShutdownError, ResourceUnavailableError
from podium.testing.conformance.base import WORLD, BackendFixtures, skip_unless
from podium.testing.conformance.workers import (
    ConformanceWorker,
    LifecycleWorker,
    Unloadable,
)

# A package the test writes to a temporary directory and puts on PYTHONPATH:
# importable by the workers, outside site-packages (like an editable install).
KINDS = """
import importlib

from podium import Dispatch, Worker, register


class Token:
    registry = []

    def __init__(self, value):
        self.value = value


class TokenWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def check(self, token):
        # The module as any other code in the worker imports it.
        module = importlib.import_module(Token.__module__)
        return (
            isinstance(token, module.Token),
            type(token).registry is module.Token.registry,
            type(self) is module.TokenWorker,
            token.value,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def make(self, value):
        return Token(value)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _lines(path: Path, expected: set[str], within: float) -> set[str]:
    """The lines of ``path`` once it holds ``expected`` (or after ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        lines = set(path.read_text().splitlines()) if path.exists() else set()
        if expected <= lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


class LifecycleTests(BackendFixtures):
    @pytest.mark.timeout(180)
    def test_shutdown_runs_every_ranks_hook(self, backend: Backend, tmp_path: Path) -> None:
        marker = tmp_path / "closed.txt"
        group = WorkerGroup(
            ResourcePool([2], use_gpu=False),
            ClassWithInitArgs(LifecycleWorker, marker=str(marker), controller_pid=os.getpid()),
            backend=backend,
        )
        ranks = group.whoami()
        assert ranks[1]["rank"] == 1
        if backend.capabilities.process_group and sys.platform.startswith("linux"):
            # A gloo group left open, its meshes in DTensor's caches: the rank must
            # still end it before Python's teardown (where it could abort the process).
            assert all(n > 0 for n in group.shard_a_module())
        group.shutdown()
        expected = {"shutdown 0", "shutdown 1"}
        if backend.capabilities.process_group:  # processes exit normally after the hook
            expected |= {"atexit 0 gloo 0", "atexit 1 gloo 0"}
        assert expected <= _lines(marker, expected, within=30)
        # No process of the group is left (those on this host, other than the controller).
        pids = {r["pid"] for r in ranks if r["host"] == socket.gethostname()} - {os.getpid()}
        if pids and sys.platform.startswith("linux"):
            deadline = time.monotonic() + 30
            while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert [pid for pid in pids if _alive(pid)] == []

    @pytest.mark.timeout(180)
    def test_a_dropped_group_runs_its_hooks_and_releases_its_slots(
        self, backend: Backend, tmp_path: Path
    ) -> None:
        marker = tmp_path / "closed.txt"
        pool = ResourcePool([2], use_gpu=False, max_colocate_count=1)
        cwa = ClassWithInitArgs(LifecycleWorker, marker=str(marker), controller_pid=os.getpid())
        group = WorkerGroup(pool, cwa, backend=backend)
        assert len(group.whoami()) == 2
        del group  # never shut down
        gc.collect()
        expected = {"shutdown 0", "shutdown 1"}
        assert expected <= _lines(marker, expected, within=30)
        with WorkerGroup(pool, ClassWithInitArgs(ConformanceWorker), backend=backend) as again:
            assert [o["rank"] for o in again.whoami()] == [0, 1]

    @pytest.mark.timeout(180)
    def test_importable_classes_keep_their_identity(
        self, backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        name = f"podium_suite_{uuid.uuid4().hex[:8]}"
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "kinds.py").write_text(KINDS)
        pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
        monkeypatch.setenv("PYTHONPATH", pythonpath)
        monkeypatch.syspath_prepend(str(tmp_path))
        kinds = importlib.import_module(f"{name}.kinds")
        env = {"PYTHONPATH": pythonpath} if backend.capabilities.worker_env else None
        with WorkerGroup(
            ResourcePool([2], use_gpu=False),
            ClassWithInitArgs(kinds.TokenWorker),
            backend=backend,
            worker_env=env,
        ) as group:
            assert group.check(kinds.Token(3)) == [(True, True, True, 3)] * 2
            made = group.make(4)
            assert all(type(t) is kinds.Token and t.value == 4 for t in made)

    @pytest.mark.timeout(180)
    def test_a_timed_out_call_does_not_delay_the_next_one(self, backend: Backend) -> None:
        skip_unless(backend, "call_timeout")
        skip_unless(backend, "cancels_timed_out_calls")
        with WorkerGroup(
            ResourcePool([2], use_gpu=False), ClassWithInitArgs(ConformanceWorker), backend=backend
        ) as group:
            with pytest.raises(CallTimeoutError):
                group.sleep_with_deadline(60.0)  # registered with a 1 s deadline
            start = time.monotonic()
            assert [o["rank"] for o in group.whoami()] == [0, 1]
            assert time.monotonic() - start < 20  # not behind the 60 s call

    @pytest.mark.timeout(180)
    def test_sys_exit_in_a_worker_is_a_dead_worker(self, backend: Backend) -> None:
        group = WorkerGroup(
            ResourcePool([2], use_gpu=False), ClassWithInitArgs(ConformanceWorker), backend=backend
        )
        try:
            start = time.monotonic()
            with pytest.raises(WorkerDiedError) as info:
                group.exit(on_rank=1, code=3)
            assert time.monotonic() - start < 15
            assert info.value.rank == 1
            start = time.monotonic()
            with pytest.raises(WorkerDiedError):
                group.whoami()
            assert time.monotonic() - start < 5
        finally:
            group.shutdown()

    @pytest.mark.timeout(120)
    def test_one_call_at_a_time_per_rank(self, wg: WorkerGroup) -> None:
        threads = [threading.Thread(target=wg.overlap, args=(0.05,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert wg.overlap(0) == [1] * WORLD

    @pytest.mark.timeout(180)
    def test_shutdown_with_calls_in_flight_raises_group_shutdown_error(
        self, backend: Backend
    ) -> None:
        group = WorkerGroup(
            ResourcePool([2], use_gpu=False), ClassWithInitArgs(ConformanceWorker), backend=backend
        )
        ended: list[tuple[float, BaseException | None]] = []
        ready = threading.Barrier(5)

        def call() -> None:
            ready.wait()
            try:
                group.sleep(3.0)
                ended.append((time.monotonic(), None))
            except BaseException as exc:
                ended.append((time.monotonic(), exc))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        ready.wait()
        time.sleep(1.0)  # every call submitted; one per rank running, the rest queued
        begin = time.monotonic()
        group.shutdown()
        took = time.monotonic() - begin
        for t in threads:
            t.join(30)
        errors = [exc for _, exc in ended]
        assert len(errors) == 4 and all(isinstance(e, GroupShutdownError) for e in errors), errors
        # Promptly: not after the queued calls would have run (4 x 3 s per rank).
        assert max(at for at, _ in ended) - begin < 8, [at - begin for at, _ in ended]
        assert took < 30

    @pytest.mark.timeout(120)
    def test_an_argument_that_fails_to_unpickle_is_a_remote_error(self, wg: WorkerGroup) -> None:
        with pytest.raises(RemoteError, match="refuses to be unpickled") as info:
            wg.take([0, Unloadable(), 2, 3])
        assert (info.value.rank, info.value.method) == (1, "take")
        assert isinstance(info.value, ValueError)
        assert [o["rank"] for o in wg.whoami()] == list(range(WORLD))  # still usable

    @pytest.mark.timeout(120)
    def test_a_return_value_that_does_not_pickle_is_a_remote_error(self, wg: WorkerGroup) -> None:
        with pytest.raises(RemoteError, match="cannot be pickled") as info:
            wg.bad_return(on_rank=2, kind="unsendable")
        assert (info.value.rank, info.value.method) == (2, "bad_return")
        assert [o["rank"] for o in wg.whoami()] == list(range(WORLD))

    @pytest.mark.timeout(120)
    def test_a_return_value_that_fails_to_unpickle_is_a_remote_error(self, wg: WorkerGroup) -> None:
        with pytest.raises(RemoteError, match="refuses to be unpickled") as info:
            wg.bad_return(on_rank=3, kind="unloadable")
        assert (info.value.rank, info.value.method) == (3, "bad_return")
        assert isinstance(info.value, ValueError)
        assert [o["rank"] for o in wg.whoami()] == list(range(WORLD))

    @pytest.mark.timeout(60)
    def test_a_gpu_pool_without_gpu_capability_is_refused_fast(self, backend: Backend) -> None:
        if backend.capabilities.gpu:
            pytest.skip(f"backend {backend.name!r} declares capability 'gpu'")
        if torch.cuda.is_available():
            pytest.skip("this host has a GPU; a backend without the 'gpu' capability may share it")
        start = time.monotonic()
        with pytest.raises(ResourceUnavailableError):
            WorkerGroup(
                ResourcePool([1], use_gpu=True),
                ClassWithInitArgs(ConformanceWorker),
                backend=backend,
            )
        assert time.monotonic() - start < 15
