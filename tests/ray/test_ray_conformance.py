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
