"""The inline backend keeps the backend contract the process backends keep.

Sub-workers know their rank, a mesh is declared once, ``sys.exit`` in a worker
is a dead rank (not a silent end of the controller), one call per rank at a
time, shutdown with calls in flight, bad values with their rank and method,
GPU pools without a GPU, and the workers' ``shutdown()`` hook.
"""

from __future__ import annotations

import gc
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from podium import (
    ClassWithInitArgs,
    Dispatch,
    RemoteError,
    ResourcePool,
    Worker,
    WorkerDiedError,
    WorkerGroup,
    register,
)
from podium.errors import GroupShutdownError, ResourceUnavailableError
from podium.testing.conformance.workers import Unloadable, Unsendable

WORLD = 4


class Sub(Worker):
    """A worker a worker builds inside a method (as verl's init_model does)."""


class Busy(Worker):
    closed: list[int] = []  # ranks whose shutdown hook ran, in this (the controller's) process

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.most = 0
        self.guard = threading.Lock()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sub_rank(self) -> tuple[int, int]:
        sub = Sub()
        return sub.rank, sub.world_size

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def declare_mesh_twice(self) -> None:
        self._register_dispatch_collect_info("twice", dp_rank=0, is_collect=True)
        self._register_dispatch_collect_info("twice", dp_rank=1, is_collect=False)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def overlap(self, seconds: float) -> int:
        with self.guard:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(seconds)
        with self.guard:
            self.running -= 1
        return self.most

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exit(self, on_rank: int, code: int) -> int:
        if self.rank == on_rank:
            raise SystemExit(code)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ret(self, on_rank: int, kind: str) -> Any:
        if self.rank != on_rank:
            return self.rank
        return Unloadable() if kind == "unloadable" else Unsendable()

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def take(self, value: Any) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def shutdown(self) -> None:
        Busy.closed.append(self.rank)
        if self.rank == 1:
            raise RuntimeError("rank 1 could not close its files")


def _group(world: int = WORLD) -> WorkerGroup:
    return WorkerGroup(
        ResourcePool([world], use_gpu=False), ClassWithInitArgs(Busy), backend="inline"
    )


@pytest.fixture(scope="module")
def wg() -> Iterator[WorkerGroup]:
    with _group() as group:
        yield group


def test_a_worker_built_inside_a_method_knows_its_rank(wg: WorkerGroup) -> None:
    assert wg.sub_rank() == [(r, WORLD) for r in range(WORLD)]


def test_declaring_a_mesh_twice_is_an_error_naming_the_mesh(wg: WorkerGroup) -> None:
    with pytest.raises(ValueError, match="mesh 'twice' is already registered") as err:
        wg.declare_mesh_twice()
    assert isinstance(err.value, AssertionError)  # verl asserts; ported code catches that


def test_sys_exit_in_a_worker_is_a_dead_rank_not_the_end_of_the_controller() -> None:
    group = _group()
    try:
        with pytest.raises(WorkerDiedError) as info:
            group.exit(on_rank=2, code=3)
        assert info.value.rank == 2 and info.value.exit_code == 3
        assert "sys.exit" in str(info.value)
        with pytest.raises(WorkerDiedError):  # the group is dead, as on process backends
            group.sleep(0)
    finally:
        group.shutdown()


def test_one_call_at_a_time_per_rank(wg: WorkerGroup) -> None:
    threads = [threading.Thread(target=wg.overlap, args=(0.02,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert wg.overlap(0) == [1] * WORLD


def test_shutdown_with_calls_in_flight_fails_them_promptly() -> None:
    group = _group()
    errors: list[BaseException] = []
    started = threading.Barrier(5)

    def call() -> None:
        started.wait()
        try:
            group.sleep(1.0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.3)
    begin = time.monotonic()
    group.shutdown()
    assert time.monotonic() - begin < 5  # shutdown does not wait for the calls
    for t in threads:
        t.join(15)
    assert time.monotonic() - begin < 10
    assert len(errors) == 4 and all(isinstance(e, GroupShutdownError) for e in errors), errors
    assert all(e.method == "sleep" for e in errors)  # type: ignore[attr-defined]


def test_an_argument_that_fails_to_unpickle_names_rank_and_method(wg: WorkerGroup) -> None:
    with pytest.raises(RemoteError, match="refuses to be unpickled") as info:
        wg.take([0, Unloadable(), 2, 3])
    assert isinstance(info.value, ValueError)
    assert (info.value.rank, info.value.method) == (1, "take")
    assert wg.sleep(0) == list(range(WORLD))


@pytest.mark.parametrize("kind", ["unsendable", "unloadable"])
def test_a_return_value_that_cannot_cross_names_rank_and_method(wg: WorkerGroup, kind: str) -> None:
    with pytest.raises(RemoteError) as info:
        wg.ret(on_rank=2, kind=kind)
    assert (info.value.rank, info.value.method) == (2, "ret")
    assert "cannot be pickled" in str(info.value) or "refuses to be unpickled" in str(info.value)
    pickle.loads(pickle.dumps(info.value))  # the error itself still crosses processes
    assert wg.sleep(0) == list(range(WORLD))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this host has a GPU: inline runs use_gpu pools on it"
)
def test_a_gpu_pool_without_a_gpu_is_refused_fast() -> None:
    start = time.monotonic()
    with pytest.raises(ResourceUnavailableError, match="use_gpu=False"):
        WorkerGroup(ResourcePool([2]), ClassWithInitArgs(Busy), backend="inline")
    assert time.monotonic() - start < 5


def test_shutdown_runs_every_ranks_hook_and_logs_a_failing_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    Busy.closed.clear()
    group = _group()
    with caplog.at_level(logging.WARNING, logger="podium.inline"):
        group.shutdown()
    assert sorted(Busy.closed) == list(range(WORLD))
    assert "rank 1 could not close its files" in caplog.text
    group.shutdown()
    assert sorted(Busy.closed) == list(range(WORLD))  # once


def test_a_dropped_group_runs_every_ranks_hook(caplog: pytest.LogCaptureFixture) -> None:
    Busy.closed.clear()
    group = _group(2)
    assert group.sleep(0) == [0, 1]
    with caplog.at_level(logging.WARNING, logger="podium.inline"):
        del group
        gc.collect()
    assert sorted(Busy.closed) == [0, 1]
    assert "rank 1 could not close its files" in caplog.text


def test_a_dropped_group_is_freed_at_once_after_its_methods_were_called() -> None:
    Busy.closed.clear()
    group = _group(2)
    assert group.sleep(0) == [0, 1]  # caches the bound caller on the group
    alive = weakref.ref(group)
    gc.disable()  # freed by reference counting alone, not by a later collection
    try:
        del group
        assert alive() is None
        assert sorted(Busy.closed) == [0, 1]
    finally:
        gc.enable()


def test_a_group_used_in_one_expression_lives_through_the_call() -> None:
    assert _group(2).sleep(0) == [0, 1]


class _Decorated(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> int:
        return self.rank


def test_a_ray_remote_decorated_worker_class_is_accepted() -> None:
    # verl decorates its workers with @ray.remote; podium starts the processes itself.
    ray = pytest.importorskip("ray")
    cwa = ClassWithInitArgs(ray.remote(_Decorated))
    assert cwa.cls is _Decorated
    with WorkerGroup(ResourcePool([2], use_gpu=False), cwa, backend="inline") as wg:
        assert wg.where() == [0, 1]
