"""verl's worker-side names work on podium: mesh queries, composite meshes, the
``Worker`` constructor and helpers, the group's old keyword spelling, and the
per-group environment names."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import torch

from podium import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    create_colocated_worker_raw_cls,
    get,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)

WORLD = 4


def pool(n: int = WORLD) -> ResourcePool:
    return ResourcePool([n], use_gpu=False)


class MeshSub(Worker):
    """A sub-worker that registers a DP=2 x TP=2 mesh (rank 0 of each replica collects)."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info(
            "actor", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0
        )


class Composite(Worker):
    """verl's composite worker: copies its sub-worker's mesh under its own name."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = MeshSub()
        self.set_dispatch_collect("actor", **self.actor.get_dispatch_collect())

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))
    def tag(self, data: DataProto) -> DataProto:
        data.batch["x"] = data.batch["x"] + 100 * self.rank
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def places(self) -> dict[str, Any]:
        return self.get_dispatch_collect()


@pytest.fixture(scope="module")
def composite() -> Any:
    with WorkerGroup(pool(), ClassWithInitArgs(Composite), backend="inline") as wg:
        yield wg


def test_the_group_queries_each_ranks_place_in_a_mesh(composite: WorkerGroup) -> None:
    assert composite._query_dispatch_info("actor") == [0, 0, 1, 1]
    assert composite._query_collect_info("actor") == [True, False, True, False]


def test_a_composite_dispatches_like_its_sub_worker(composite: WorkerGroup) -> None:
    out = composite.tag(DataProto.from_dict({"x": torch.arange(4)}))
    # Replica 0 is ranks 0-1 (rank 0 collects), replica 1 ranks 2-3 (rank 2 collects).
    assert out.batch["x"].tolist() == [0, 1, 202, 203]
    assert composite.places()[3] == {
        "dispatch_dp_rank": {"actor": 1},
        "collect_dp_rank": {"actor": False},
    }


def test_an_unregistered_mesh_is_an_error_naming_the_fix(composite: WorkerGroup) -> None:
    with pytest.raises(ValueError, match="_register_dispatch_collect_info"):
        composite._query_dispatch_info("critic")


def test_set_dispatch_collect_refuses_an_ambiguous_source() -> None:
    class Two(Worker):
        pass

    w = Two()
    src = {"dispatch_dp_rank": {"a": 0, "b": 1}, "collect_dp_rank": {"a": True, "b": False}}
    with pytest.raises(ValueError, match="exactly one mesh"):
        w.set_dispatch_collect("c", **src)
    w.set_dispatch_collect("b", **src)
    assert w._query_dispatch_info("b") == 1 and w.query_collect_info("b") is False
    with pytest.raises(ValueError, match="already registered"):
        w.set_dispatch_collect("b", **src)


class Helpers(Worker):
    def __init__(self, devices: str | None = None) -> None:
        super().__init__(cuda_visible_devices=devices)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def helpers(self) -> tuple[Any, str, dict[str, str | None]]:
        env = {k: os.environ.get(k) for k in ("WG_PREFIX", "WG_BACKEND")}
        return self.get_master_addr_port(), self.get_cuda_visible_devices(), env


def test_worker_helpers_and_constructor_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test, set or not
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with WorkerGroup(pool(1), ClassWithInitArgs(Helpers), backend="inline") as wg:
        ((addr_port, devices, env),) = wg.helpers()
    # Inline ranks have no rendezvous and share the controller's environment.
    assert addr_port == (None, None) and devices == "not set"
    assert env == {"WG_PREFIX": None, "WG_BACKEND": None}
    with WorkerGroup(pool(1), ClassWithInitArgs(Helpers, "3"), backend="inline") as wg:
        assert wg.helpers()[0][1] == "3"
    with pytest.raises(TypeError, match="cuda_visible_devices"):
        Worker(cuda_visible_devices=3)  # type: ignore[arg-type]


def test_the_verl_keyword_spelling_starts_a_group_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="cls_with_init"):
        wg = WorkerGroup(
            resource_pool=pool(2), ray_cls_with_init=ClassWithInitArgs(Helpers), backend="inline"
        )
    with wg:
        assert wg.world_size == 2
    with pytest.raises(TypeError, match="not both"):
        WorkerGroup(
            pool(1), ClassWithInitArgs(Helpers), ray_cls_with_init=ClassWithInitArgs(Helpers)
        )
    with pytest.raises(TypeError, match="needs cls_with_init"):
        WorkerGroup(pool(1), backend="inline")


class ActorRole(Worker):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self) -> tuple[str, int, float, int]:
        return "actor", self.rank, self.lr, os.getpid()


class CriticRole(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def value(self, data: DataProto) -> DataProto:
        # Roles reach each other through fused_worker_dict, as in verl.
        lr = self.fused_worker_dict["actor"].lr
        return DataProto.from_dict({"v": data.batch["x"] * lr})


def roles() -> dict[str, ClassWithInitArgs[Any]]:
    return {"actor": ClassWithInitArgs(ActorRole, lr=0.5), "critic": ClassWithInitArgs(CriticRole)}


class Fused(create_colocated_worker_raw_cls(roles())):  # type: ignore[misc]
    """A user subclass of the raw fused class: its own methods reach the roles."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def both(self) -> tuple[float, bool]:
        return self.actor.lr, self.get_fused_worker_by_name("critic") is self.critic


def test_a_raw_fused_class_subclassed_and_fused_calls_each_role_in_the_same_processes() -> None:
    with WorkerGroup(pool(2), ClassWithInitArgs(Fused), backend="inline") as wg:
        assert wg.both() == [(0.5, True)] * 2
        views = wg.fuse(["actor", "critic"])
        assert set(views) == {"actor", "critic"} and wg.actor is views["actor"]
        steps = wg.actor.step()
        assert [s[:3] for s in steps] == [("actor", 0, 0.5), ("actor", 1, 0.5)]
        out = wg.critic.value(DataProto.from_dict({"x": torch.arange(4.0)}))
        assert out.batch["v"].tolist() == [0.0, 0.5, 1.0, 1.5]
        with pytest.raises(ValueError, match="already has attributes"):
            wg.fuse(["both"])


def test_the_raw_fused_class_validates_its_roles() -> None:
    with pytest.raises(ValueError, match="at least one role"):
        create_colocated_worker_raw_cls({})
    with pytest.raises(TypeError, match="ClassWithInitArgs"):
        create_colocated_worker_raw_cls({"actor": ActorRole})  # type: ignore[dict-item]


class AsyncWorker(Worker):
    max_async_calls = 2

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0
        self.running = 0
        self.most = 0
        self.task: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def start_ticking(self) -> None:
        async def tick() -> None:
            while True:
                self.ticks += 1
                await asyncio.sleep(0.005)

        self.task = asyncio.get_running_loop().create_task(tick())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ticks_now(self) -> int:
        return self.ticks

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def hold(self, seconds: float) -> int:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running -= 1
        return self.most

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def hold_async(self, seconds: float) -> int:
        return await self.hold(seconds)


def test_a_task_started_by_an_async_call_keeps_running_between_calls() -> None:
    with WorkerGroup(pool(2), ClassWithInitArgs(AsyncWorker), backend="inline") as wg:
        wg.start_ticking()
        first = wg.ticks_now()
        time.sleep(0.2)  # no call runs meanwhile: the loop keeps going on its own
        later = wg.ticks_now()
        assert all(b > a + 5 for a, b in zip(first, later))


def test_async_calls_overlap_up_to_max_async_calls() -> None:
    with WorkerGroup(pool(1), ClassWithInitArgs(AsyncWorker), backend="inline") as wg:
        started = time.monotonic()
        futures = [wg.hold_async(0.3) for _ in range(4)]
        assert wg.ticks_now() == [0]  # a sync call is not stuck behind the async ones
        assert time.monotonic() - started < 0.25
        most = max(get(f)[0] for f in futures)
        # Four calls of 0.3 s, two at a time: about 0.6 s, never more than two at once.
        assert most == 2
        assert 0.5 < time.monotonic() - started < 1.1


def test_inline_native_handles_are_the_worker_objects() -> None:
    from podium.backends.inline import InlineHandles

    with WorkerGroup(pool(2), ClassWithInitArgs(Fused), backend="inline") as wg:
        wg.fuse(["actor"])
        handles = wg.backend_handles
        assert isinstance(handles, InlineHandles) and wg.actor.backend_handles == handles
        assert [type(w) for w in handles.workers] == [Fused, Fused]
        assert [w.actor.rank for w in handles.workers] == [0, 1]


def test_pool_takes_verls_remaining_positional_arguments_at_their_defaults() -> None:
    p = ResourcePool([2], False, "named", 2, False, None)
    assert (p.world_size, p.use_gpu, p.name_prefix, p.max_colocate_count) == (2, False, "named", 2)
    with pytest.raises(ValueError, match="WorkerGroup.attach"):
        ResourcePool([2], False, None, 1, True)
    with pytest.raises(ValueError, match="accelerator_type"):
        ResourcePool([2], True, None, 1, False, "H100")


def test_async_targets_are_known_from_the_class_and_the_bound_is_checked() -> None:
    from podium.backend_api import is_async_target, max_async_calls

    fused = ClassWithInitArgs(Fused)
    assert is_async_target(ClassWithInitArgs(AsyncWorker), "hold")
    assert not is_async_target(ClassWithInitArgs(AsyncWorker), "ticks_now")
    assert not is_async_target(fused, "actor:step") and not is_async_target(fused, "nobody:step")
    assert max_async_calls(AsyncWorker) == 2 and max_async_calls(Worker) == 16

    class Unbounded(AsyncWorker):
        max_async_calls = 0

    with pytest.raises(ValueError, match="max_async_calls must be an int >= 1"):
        WorkerGroup(pool(1), ClassWithInitArgs(Unbounded), backend="inline")
