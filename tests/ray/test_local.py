"""The Ray backend on one local Ray with logical GPUs: placement, data paths, failures, cleanup."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from _raytools import eventually, live_actor_names, live_placement_groups, restart_ray, stop_ray

from podium import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    ResourcePoolManager,
    Worker,
    WorkerGroup,
    get,
    register,
    split_resource_pool,
)
from podium.backends.ray import futures as ray_futures
from podium.core.backend import RESERVED_ENV
from podium.errors import RemoteError, ResourceUnavailableError, WorkerDiedError
from podium.testing.conformance.workers import MeshWorker

pytestmark = pytest.mark.timeout(120)

GPUS = 4


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    restart_ray(num_cpus=16, num_gpus=GPUS)
    yield
    stop_ray()


class Probe(Worker):
    def __init__(self, tag: Any = "") -> None:
        self.tag = tag

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def info(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "tag_len": len(self.tag),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "env": {k: os.environ.get(k) for k in (*RESERVED_ENV, "PODIUM_TEST_VAR")},
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sleep(self, seconds: float) -> int:
        print(f"rank {self.rank} sleeping", flush=True)
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        data.batch["x"] *= 2  # the received tensors are writable
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, data: DataProto) -> DataProto:
        data.batch["x"] *= 2
        return data


class FailingInit(Worker):
    def __init__(self) -> None:
        if self.rank == 1:
            raise ValueError("rank 1 refuses to start")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank


def _gpus(wg: WorkerGroup) -> list[str]:
    return [i["gpus"] for i in wg.info()]


# -- placement ---------------------------------------------------------------


def test_each_gpu_rank_sees_its_own_device() -> None:
    with WorkerGroup(ResourcePool([GPUS]), ClassWithInitArgs(Probe), backend="ray") as wg:
        ids = _gpus(wg)
    assert sorted(ids) == [str(i) for i in range(GPUS)]


def test_colocated_groups_share_devices_and_respect_the_limit() -> None:
    pool = ResourcePool([2], max_colocate_count=2)
    with (
        WorkerGroup(pool, ClassWithInitArgs(Probe), backend="ray") as a,
        WorkerGroup(pool, ClassWithInitArgs(Probe), backend="ray") as b,
    ):
        assert _gpus(a) == _gpus(b)
        assert len(set(_gpus(a))) == 2
        start = time.monotonic()
        with pytest.raises(ResourceUnavailableError, match="max_colocate_count"):
            WorkerGroup(pool, ClassWithInitArgs(Probe), backend="ray")
        assert time.monotonic() - start < 5


def test_split_pools_get_disjoint_devices() -> None:
    first, second = split_resource_pool(ResourcePool([GPUS]), 2)
    with (
        WorkerGroup(first, ClassWithInitArgs(Probe), backend="ray") as a,
        WorkerGroup(second, ClassWithInitArgs(Probe), backend="ray") as b,
    ):
        ga, gb = set(_gpus(a)), set(_gpus(b))
        envs = [i["env"] for i in b.info()]
    assert not ga & gb and len(ga | gb) == GPUS
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert [e["WORLD_SIZE"] for e in envs] == ["2", "2"]


def test_infeasible_pools_fail_fast_with_demand_and_supply() -> None:
    start = time.monotonic()
    with pytest.raises(ResourceUnavailableError) as info:
        WorkerGroup(ResourcePool([2 * GPUS]), ClassWithInitArgs(Probe), backend="ray")
    assert time.monotonic() - start < 10
    err = info.value
    assert err.demand["total"]["GPU"] == 2 * GPUS and err.supply["total"]["GPU"] == GPUS
    assert "GPU" in str(err) and "use_gpu=False" in str(err)
    with pytest.raises(ResourceUnavailableError, match="CPU"):
        WorkerGroup(ResourcePool([100], use_gpu=False), ClassWithInitArgs(Probe), backend="ray")
    assert live_placement_groups() == []


def test_resource_pool_manager_checks_every_pool_before_starting() -> None:
    manager = ResourcePoolManager({"actor": [3], "critic": [3]}, {"a": "actor", "c": "critic"})
    with pytest.raises(ResourceUnavailableError, match="need 6 GPU"):
        manager.create_resource_pool("ray")
    ok = ResourcePoolManager({"actor": [2], "critic": [2]}, {"a": "actor", "c": "critic"})
    ok.create_resource_pool("ray")
    assert live_placement_groups() == []  # checking starts nothing


def test_busy_pool_waits_for_placement_timeout_then_raises() -> None:
    with WorkerGroup(ResourcePool([GPUS]), ClassWithInitArgs(Probe), backend="ray"):
        start = time.monotonic()
        with pytest.raises(ResourceUnavailableError, match="placement_timeout"):
            WorkerGroup(
                ResourcePool([1]),
                ClassWithInitArgs(Probe),
                backend="ray",
                backend_options={"placement_timeout": 1.5},
            )
        assert 1.5 <= time.monotonic() - start < 10


# -- environment ---------------------------------------------------------------


def test_rank_env_and_worker_env() -> None:
    pool = ResourcePool([3], use_gpu=False)
    big = torch.ones(1 << 18)  # constructor arguments above Ray's inline limit go in the store once
    with WorkerGroup(
        pool, ClassWithInitArgs(Probe, big), backend="ray", worker_env={"PODIUM_TEST_VAR": "yes"}
    ) as wg:
        infos = wg.info()
    envs = [i["env"] for i in infos]
    assert {i["tag_len"] for i in infos} == {1 << 18}
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert {e["PODIUM_TEST_VAR"] for e in envs} == {"yes"}
    with pytest.raises(ValueError, match="MASTER_PORT"):
        WorkerGroup(pool, ClassWithInitArgs(Probe), backend="ray", worker_env={"MASTER_PORT": "1"})


# -- named workers ---------------------------------------------------------------


def test_attach_reaches_named_workers_without_owning_them() -> None:
    pool = ResourcePool([2], use_gpu=False)
    with WorkerGroup(
        pool, ClassWithInitArgs(Probe), backend="ray", name_prefix="probe_named"
    ) as wg:
        assert wg.worker_names == ["probe_named_0", "probe_named_1"]
        attached = WorkerGroup.attach("probe_named", Probe, backend="ray")
        assert [i["pid"] for i in attached.info()] == [i["pid"] for i in wg.info()]
        attached.shutdown()
        assert len(wg.info()) == 2  # detaching left the workers running
        with pytest.raises(ValueError, match="name_prefix"):
            WorkerGroup(
                ResourcePool([1], use_gpu=False),
                ClassWithInitArgs(Probe),
                backend="ray",
                name_prefix="probe_named",
            )
    with pytest.raises(LookupError, match="probe_named"):
        WorkerGroup.attach("probe_named", Probe, backend="ray")


def test_attach_looks_names_up_without_listing_every_actor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(Probe),
        backend="ray",
        name_prefix="probe_direct",
    ) as wg:

        def listing(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("attach listed the named actors of every namespace")

        monkeypatch.setattr(ray.util, "list_named_actors", listing)
        attached = WorkerGroup.attach("probe_direct", Probe, backend="ray")
        assert [i["rank"] for i in attached.info()] == [i["rank"] for i in wg.info()]
        attached.shutdown()


# -- data paths ------------------------------------------------------------------


def test_nd_mesh_puts_each_dp_shard_once(monkeypatch: pytest.MonkeyPatch) -> None:
    with WorkerGroup(
        ResourcePool([4], use_gpu=False), ClassWithInitArgs(MeshWorker, tp_size=2), backend="ray"
    ) as wg:
        data = DataProto.from_dict(
            {"x": torch.arange(2 * 65536, dtype=torch.float32).reshape(8, -1)}
        )
        wg.shard(data)  # warm up: learn the mesh layout
        puts = []
        real_put = ray.put
        monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(1) or real_put(value, **kw))
        out = wg.shard(data)
    assert len(puts) == 2  # DP size 2, TP size 2: one object per replica
    assert torch.equal(out.batch["x"], data.batch["x"])


def test_dataproto_future_moves_worker_to_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ResourcePool([2], use_gpu=False, max_colocate_count=2)
    with (
        WorkerGroup(pool, ClassWithInitArgs(Probe), backend="ray") as a,
        WorkerGroup(pool, ClassWithInitArgs(Probe), backend="ray") as b,
    ):
        data = DataProto.from_dict({"x": torch.arange(8.0)})
        future = a.double_async(data)
        gathered_here: list[int] = []
        real_gather = ray_futures.RayRankFuture.gather.__func__  # type: ignore[attr-defined]

        def spy(cls: Any, futures: Any, timeout: Any = None) -> Any:
            gathered_here.extend(id(f) for f in futures)
            return real_gather(cls, futures, timeout)

        monkeypatch.setattr(ray_futures.RayRankFuture, "gather", classmethod(spy))
        out = b.double(future)
    assert torch.equal(out.batch["x"], torch.arange(8.0) * 4)
    # b's results came back here; a's went from a's workers straight to b's
    assert gathered_here and not {id(f) for f in future.futures} & set(gathered_here)
    assert torch.equal(data.batch["x"], torch.arange(8.0))  # the caller's data is untouched
    out.batch["x"] += 1  # results are writable


# -- failures and cleanup ----------------------------------------------------------


def test_worker_killed_mid_call_is_reported_fast_then_fails_fast() -> None:
    with WorkerGroup(
        ResourcePool([4], use_gpu=False), ClassWithInitArgs(Probe), backend="ray"
    ) as wg:
        pids = [i["pid"] for i in wg.info()]
        futures = wg.sleep(60)
        time.sleep(0.5)
        os.kill(pids[2], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            get(futures, timeout=30)
        assert time.monotonic() - start < 5
        assert info.value.rank == 2
        assert "rank 2 sleeping" in info.value.log_tail
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 2"):
            wg.info()
        assert time.monotonic() - start < 1
    assert eventually(lambda: live_actor_names("Probe") == [])


def test_failing_constructor_raises_the_users_error_and_leaves_nothing() -> None:
    with pytest.raises(ValueError, match="refuses") as info:
        WorkerGroup(
            ResourcePool([2], use_gpu=False),
            ClassWithInitArgs(FailingInit),
            backend="ray",
            name_prefix="failing",
        )
    assert isinstance(info.value, RemoteError) and info.value.rank == 1
    assert eventually(lambda: live_actor_names("failing") == [])
    assert live_placement_groups() == []


def test_shutdown_leaves_no_actors_or_placement_groups() -> None:
    wg = WorkerGroup(
        ResourcePool([2, 1], use_gpu=False),
        ClassWithInitArgs(Probe),
        backend="ray",
        name_prefix="tidy",
    )
    assert live_actor_names("tidy") == ["tidy_0", "tidy_1", "tidy_2"]
    assert len(live_placement_groups()) == 2
    wg.shutdown()
    wg.shutdown()
    assert eventually(lambda: live_actor_names("tidy") == [])
    assert live_placement_groups() == []
