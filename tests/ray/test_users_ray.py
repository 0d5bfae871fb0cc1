"""A Ray the user started and shut down themselves (as verl's tests do) stays shut down."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import ray

from podium import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, register


class Pinger(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank


@pytest.mark.timeout(180)
def test_a_group_dropped_after_the_user_shut_ray_down_does_not_start_ray_again() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        wg = WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Pinger), backend="ray")
        assert wg.ping() == [0]
    finally:
        ray.shutdown()
    del wg
    gc.collect()
    deadline = time.monotonic() + 30
    while any(t.name == "podium-ray-stop" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the dropped group's stop did not finish"
        time.sleep(0.1)
    assert not ray.is_initialized()
