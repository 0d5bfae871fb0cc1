"""The conformance suite against the torchrun backend (real torchx, torchrun and ZeroMQ)."""

import pytest

from podium.testing.conformance import ConformanceSuite

pytest.importorskip("torchx")
pytest.importorskip("zmq")

pytestmark = pytest.mark.timeout(240)


class TestTorchrunConformance(ConformanceSuite):
    backend_name = "torchrun"


def test_torchrun_native_handles_name_each_ranks_process() -> None:
    from podium import ClassWithInitArgs, ResourcePool, WorkerGroup
    from podium.backends.torchrun import TorchrunHandles
    from podium.testing.conformance.workers import ConformanceWorker

    with WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(ConformanceWorker), backend="torchrun"
    ) as wg:
        handles = wg.backend_handles
        assert isinstance(handles, TorchrunHandles)
        assert handles.pids == [o["pid"] for o in wg.whoami()]
        assert all(handles.hosts) and handles.control_address.startswith("tcp://")
