"""The conformance suite against the torchrun backend (real torchx, torchrun and ZeroMQ)."""

import pytest
import torch

from podium import DataProto, WorkerGroup, get
from podium.testing.conformance import ConformanceSuite

pytest.importorskip("torchx")
pytest.importorskip("zmq")

pytestmark = pytest.mark.timeout(240)


class TestTorchrunConformance(ConformanceSuite):
    backend_name = "torchrun"

    def test_rows_of_two_producers_reach_a_consumer_without_a_copy(
        self, pair_wg: WorkerGroup, trio_wg: WorkerGroup
    ) -> None:
        # 300 rows of 4 KiB over 2 producers (150 each) -> 3 consumers of 100: the
        # middle one's rows lie in both shards, mapped side by side in its process.
        w = torch.arange(300 * 1024, dtype=torch.float32).reshape(300, 1024)
        a = pair_wg.ref_stage(DataProto.from_dict({"x": w[:, 0], "w": w}))
        b = trio_wg.bump_ref(a)
        where = trio_wg.last_input()
        assert [p["rows"] for p in where] == [100] * 3
        assert all(str(p["file"]).startswith("/dev/shm/") for p in where), where
        assert torch.equal(get(b).batch["w"], w + 1.0)
        a.release()
        b.release()


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
