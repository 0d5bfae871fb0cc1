"""The conformance suite against the Ray backend (a local Ray that podium starts itself)."""

import os
from collections.abc import Iterator

import pytest
from _raytools import restart_ray, stop_ray

from podium import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, register
from podium.testing.conformance import ConformanceSuite

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def no_other_ray() -> Iterator[None]:
    restart_ray()  # the backend starts its own local Ray, as it does for users
    yield
    stop_ray()


class TestRayConformance(ConformanceSuite):
    backend_name = "ray"


class Niceness(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def niceness(self) -> int:
        return os.nice(0)


def test_workers_of_a_local_ray_run_at_the_controllers_priority() -> None:
    """Ray's default niceness 15 would starve them on a busy host (a torchrun worker has 0)."""
    with WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(Niceness), backend="ray"
    ) as wg:
        assert wg.niceness() == [os.nice(0)] * 2


class TorchAllocator(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def huge_pages(self) -> str | None:
        return os.environ.get("THP_MEM_ALLOC_ENABLE")


def test_workers_of_a_local_ray_put_large_torch_tensors_in_huge_pages() -> None:
    """Fresh result tensors on every call: 4 KiB page faults would cost more than the bytes."""
    with WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(TorchAllocator), backend="ray"
    ) as wg:
        assert wg.huge_pages() == ["1", "1"]


class RayEnv(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ray_env(self) -> dict[str, str | None]:
        names = ("RAY_LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE", "WG_PREFIX", "WG_BACKEND")
        return {name: os.environ.get(name) for name in names}


def test_ray_ranks_have_verls_variables_and_their_native_handles_are_reachable() -> None:
    import ray

    from podium.backends.ray import RayHandles

    with WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(RayEnv),
        backend="ray",
        name_prefix="verl_env",
    ) as wg:
        assert wg.ray_env() == [
            {
                "RAY_LOCAL_RANK": str(r),
                "RAY_LOCAL_WORLD_SIZE": "2",
                "WG_PREFIX": "verl_env",
                "WG_BACKEND": "ray",
            }
            for r in range(2)
        ]
        handles = wg.backend_handles
        assert isinstance(handles, RayHandles)
        assert len(handles.actors) == len(handles.placement_groups) == 2
        assert sorted(handles.bundle_indices) == [0, 1]
        pids = ray.get([a.where.remote() for a in handles.actors])
        assert [w[2] for w in pids] == handles.pids
        table = ray.util.placement_group_table(handles.placement_groups[0])
        assert table["state"] == "CREATED"
