"""Conformance: async methods, futures, ranks and environment, colocation, pools."""

from __future__ import annotations

import time

import pytest
import torch

from podium import (
    CallTimeoutError,
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    RankFuture,
    RemoteError,
    ResourcePool,
    WorkerGroup,
    get,
    split_resource_pool,
)
from podium.core.backend import Backend
from podium.testing.conformance.base import WORLD, BackendFixtures, skip_unless
from podium.testing.conformance.workers import ConformanceWorker, FusedActorCritic


def batch(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32)})


class ExecutionTests(BackendFixtures):
    def test_async_def_methods_run(self, wg: WorkerGroup) -> None:
        assert wg.async_double(21, delay=0.01) == [(r, 42) for r in range(WORLD)]

    def test_a_task_an_async_call_starts_keeps_running_between_calls(self, wg: WorkerGroup) -> None:
        wg.start_ticking(0.01)
        try:
            first = wg.ticks_now()
            time.sleep(0.5)  # no call runs meanwhile: each rank's event loop keeps going
            later = wg.ticks_now()
        finally:
            wg.stop_ticking()
        assert all(b >= a + 5 for a, b in zip(first, later)), (first, later)

    def test_async_calls_overlap_and_do_not_hold_up_other_calls(
        self, backend: Backend, wg: WorkerGroup
    ) -> None:
        skip_unless(backend, "concurrent_async_calls")
        started = time.monotonic()
        futures = [wg.hold_async(1.0) for _ in range(3)]
        assert [o["rank"] for o in wg.whoami()] == list(range(WORLD))  # not behind them
        assert time.monotonic() - started < 0.9
        most = [max(per_call) for per_call in zip(*(get(f) for f in futures))]
        assert most == [3] * WORLD
        assert time.monotonic() - started < 2.5  # about 1 s: the three ran at once

    def test_nonblocking_returns_rank_futures(self, wg: WorkerGroup) -> None:
        futures = wg.nonblocking(1)
        assert isinstance(futures, list) and all(isinstance(f, RankFuture) for f in futures)
        assert get(futures) == [(r, 2) for r in range(WORLD)]
        assert get(futures) == [(r, 2) for r in range(WORLD)]  # resolving twice is fine

    def test_execute_all_async_and_sync(self, wg: WorkerGroup) -> None:
        futures = wg.execute_all_async("echo", [0, 1, 2, 3])
        assert [r for r, _, _ in get(futures)] == list(range(WORLD))
        assert [args for _, args, _ in wg.execute_all_sync("echo", "all")] == [("all",)] * WORLD
        assert wg.execute_rank_zero_sync("echo", 9) == (0, (9,), {})
        assert get(wg.execute_rank_zero_async("echo", 8)) == (0, (8,), {})

    def test_data_proto_future_feeds_another_call(self, wg: WorkerGroup, mesh_wg: WorkerGroup) -> None:
        fut = wg.add_rank_async(batch(8))
        assert isinstance(fut, DataProtoFuture)
        out = mesh_wg.shard(fut)  # into another group's call
        assert out.batch["x"].tolist() == [float(i + i // 2) for i in range(8)]
        again = wg.add_rank(wg.add_rank_async(batch(4)))
        assert again.batch["x"].tolist() == [float(i + 2 * i) for i in range(4)]

    def test_materialize_futures_false_passes_the_future(self, backend: Backend, wg: WorkerGroup) -> None:
        skip_unless(backend, "worker_to_worker_futures")
        names = wg.future_type(wg.add_rank_async(batch(4)))
        assert set(names) == {"DataProtoFuture"}

    def test_ranks_are_known_from_init(self, wg: WorkerGroup) -> None:
        out = wg.whoami()
        for r, o in enumerate(out):
            assert o["at_init"] == (r, WORLD, r, WORLD)
            assert (o["rank"], o["world_size"], o["local_rank"], o["local_world_size"]) == (r, WORLD, r, WORLD)

    def test_process_environment_supports_init_process_group(self, backend: Backend, wg: WorkerGroup) -> None:
        skip_unless(backend, "process_group")
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        envs = wg.env(*names)
        for r, env in enumerate(envs):
            assert env["RANK"] == str(r) and env["WORLD_SIZE"] == str(WORLD)
            assert env["LOCAL_RANK"] == str(r) and env["LOCAL_WORLD_SIZE"] == str(WORLD)
            assert env["MASTER_ADDR"] and env["MASTER_PORT"]
        assert len({e["MASTER_ADDR"] for e in envs}) == 1 and len({e["MASTER_PORT"] for e in envs}) == 1
        assert wg.all_reduce_rank() == [float(sum(range(WORLD)))] * WORLD

    def test_worker_env_reaches_the_workers(self, backend: Backend) -> None:
        skip_unless(backend, "worker_env")
        with WorkerGroup(
            ResourcePool([1], use_gpu=False),
            ClassWithInitArgs(ConformanceWorker),
            backend=backend,
            worker_env={"PODIUM_SUITE_FLAG": "on"},
        ) as group:
            assert group.env("PODIUM_SUITE_FLAG") == [{"PODIUM_SUITE_FLAG": "on"}]

    def test_worker_env_may_not_override_rank_variables(self, backend: Backend) -> None:
        with pytest.raises(ValueError, match="RANK"):
            WorkerGroup(
                ResourcePool([1], use_gpu=False),
                ClassWithInitArgs(ConformanceWorker),
                backend=backend,
                worker_env={"RANK": "3"},
            )

    def test_colocated_roles_share_one_process_per_rank(self, colocated: dict[str, WorkerGroup]) -> None:
        actor, critic = colocated["actor"], colocated["critic"]
        a = actor.describe()
        c = critic.describe()
        assert [x[:2] for x in a] == [("actor", 0), ("actor", 1)]
        assert [x[:2] for x in c] == [("critic", 0), ("critic", 1)]
        assert [x[2] for x in a] == [x[2] for x in c]  # same process per rank
        assert a[0][3] == 0.5
        assert actor.score(batch(4)).batch["x"].tolist() == [0.0, 2.0, 4.0, 6.0]
        assert critic.value(batch(2)).batch["x"].tolist() == [100.0, 101.0]
        with pytest.raises(AttributeError):
            actor.value  # noqa: B018 - the critic's method is not the actor's

    def test_a_fused_class_and_its_roles_run_in_the_same_processes(self, backend: Backend) -> None:
        with WorkerGroup(
            ResourcePool([2], use_gpu=False), ClassWithInitArgs(FusedActorCritic), backend=backend
        ) as wg:
            own = wg.actor_lr()
            wg.fuse(["actor", "critic"])
            roles = wg.actor.describe()
            assert [(r, lr) for r, lr, _ in own] == [(0, 0.25), (1, 0.25)]
            assert [(x[0], x[1], x[3]) for x in roles] == [("actor", 0, 0.25), ("actor", 1, 0.25)]
            assert [pid for _, _, pid in own] == [x[2] for x in roles]  # same process per rank
            assert wg.critic.value(batch(2)).batch["x"].tolist() == [100.0, 101.0]

    def test_group_names_are_in_the_rank_environment(
        self, backend: Backend, wg: WorkerGroup
    ) -> None:
        skip_unless(backend, "worker_env")
        envs = wg.env("WG_PREFIX", "WG_BACKEND")
        assert envs == [{"WG_PREFIX": wg.name_prefix, "WG_BACKEND": backend.name}] * WORLD

    def test_spawn_needs_a_colocated_group(self, wg: WorkerGroup) -> None:
        with pytest.raises(TypeError, match="create_colocated_worker_cls"):
            wg.spawn({"actor"})

    def test_two_groups_share_one_pool(self, backend: Backend, pool: ResourcePool, wg: WorkerGroup) -> None:
        skip_unless(backend, "fractional_colocation")
        with WorkerGroup(pool, ClassWithInitArgs(ConformanceWorker, offset=1), backend=backend) as other:
            assert [o["offset"] for o in other.whoami()] == [1] * WORLD
            assert [o["offset"] for o in wg.whoami()] == [5] * WORLD

    def test_split_pools_each_start_at_rank_zero(self, backend: Backend) -> None:
        first, second = split_resource_pool(ResourcePool([2], use_gpu=False), 1)
        with WorkerGroup(first, ClassWithInitArgs(ConformanceWorker), backend=backend) as a:
            with WorkerGroup(second, ClassWithInitArgs(ConformanceWorker), backend=backend) as b:
                assert [o["rank"] for o in a.whoami()] == [0]
                assert [o["world_size"] for o in b.whoami()] == [1]

    def test_calls_without_arguments(self, wg: WorkerGroup) -> None:
        # Each twice: the second call takes the path the first one chose and kept.
        ranks = list(range(WORLD))
        for _ in range(2):
            assert [o["rank"] for o in wg.whoami()] == ranks
            assert [r for r, _, _ in wg.echo()] == ranks  # ALL_TO_ALL
            assert wg.rank_zero_bare() == 0
            futures = wg.later_bare()
            assert all(isinstance(f, RankFuture) for f in futures) and get(futures) == ranks
            assert wg.build_bare() == [(r, WORLD) for r in ranks]
            assert wg.coroutine_bare() == ranks
            with pytest.raises(ValueError, match="bare failure on rank") as info:
                wg.fail_bare()
            assert isinstance(info.value, RemoteError) and info.value.rank in ranks

    def test_a_call_without_arguments_keeps_its_deadline(self, backend: Backend, wg: WorkerGroup) -> None:
        skip_unless(backend, "call_timeout")
        for _ in range(2):  # the second call takes the path the first one kept
            with pytest.raises(CallTimeoutError) as info:
                wg.hang_bare()
            assert info.value.ranks and "hang_bare" in str(info.value)
            wg.sleep(0)  # the group stays usable
            assert [o["rank"] for o in wg.whoami()] == list(range(WORLD))

    def test_call_deadlines(self, backend: Backend, wg: WorkerGroup) -> None:
        skip_unless(backend, "call_timeout")
        with pytest.raises(CallTimeoutError) as info:
            wg.sleep_with_deadline(3.0)
        assert info.value.ranks and "sleep_with_deadline" in str(info.value)
        with pytest.raises(CallTimeoutError):
            get(wg.execute_all_async("sleep", 3.0), timeout=0.5)
        wg.sleep(0)  # let the slow calls drain; the group stays usable
        assert [o["rank"] for o in wg.whoami()] == list(range(WORLD))
