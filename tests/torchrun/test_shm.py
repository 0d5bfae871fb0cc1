"""Shared memory between the controller and its workers: ownership of what is read, and resources."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from podium import ClassWithInitArgs, DataProto, ResourcePool, Worker, WorkerGroup, register
from podium.backends.torchrun import wire
from podium.backends.torchrun.shm import SegmentMap, SegmentPool, unlink_prefix
from podium.core.decorator import Dispatch

N = 1 << 18  # float32: 1 MiB, through shared memory
PREFIX = "podium-testshm-"


@pytest.fixture
def pool():
    pool = SegmentPool(PREFIX + "c-")
    yield pool
    pool.close()
    unlink_prefix(PREFIX)


# -- one process ----------------------------------------------------------------------


def test_a_segment_released_once_too_often_is_handed_out_once(pool: SegmentPool) -> None:
    seg = pool.acquire(1 << 20)
    pool.hold(seg)
    pool.release([seg.name, seg.name])  # a stray second release (a reader's retry, a bug)
    first, second = pool.acquire(1 << 20), pool.acquire(1 << 20)
    assert first is seg and second is not seg  # two messages never share one segment


def test_a_reader_writes_its_own_copy_and_sees_the_owners_next_message(pool: SegmentPool) -> None:
    readers = [SegmentMap(), SegmentMap()]
    try:
        for step in range(3):
            enc = wire.encode(torch.full((N,), float(step)))
            descs = [wire.place(enc, pool)[0] for _ in readers]
            wire.done_placing(enc, pool)
            got = [wire.decode_objects([d], [enc.header], r)[0] for d, r in zip(descs, readers)]
            got[0][: N // 2].add_(1.0)  # half the pages written by one reader only
            assert float(got[0].sum()) == step * N + N // 2
            assert float(got[1].sum()) == step * N
            del got
            for reader in readers:
                pool.release(reader.take_releases())
            assert len(pool._free) == 1  # the next step reuses the segment
    finally:
        for reader in readers:
            reader.close()


class OwnerWorker(Worker):
    """Keeps what it was sent and writes into it, as a training step may."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def keep_and_bump(self, t: torch.Tensor) -> None:
        self.kept = t
        t.add_(self.rank + 1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def keep_and_bump_proto(self, data: DataProto) -> None:
        self.kept = data
        data.batch["x"].add_(self.rank + 1)
        data.non_tensor_batch["y"] += self.rank + 1

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kept_sums(self) -> list[float]:
        kept = self.kept
        if isinstance(kept, DataProto):
            return [float(kept.batch["x"].sum()), float(kept.non_tensor_batch["y"].sum())]
        return [float(kept.sum())]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def make(self, value: float) -> torch.Tensor:
        return torch.full((N,), value)


@pytest.fixture(scope="module")
def wg():
    group = WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(OwnerWorker), backend="torchrun"
    )
    yield group
    group.shutdown()


@pytest.mark.timeout(120)
def test_every_rank_owns_a_tensor_sent_to_all(wg: WorkerGroup) -> None:
    t = torch.zeros(N)
    wg.keep_and_bump(t)
    # Each rank sees its own write only, and the controller's tensor is untouched.
    assert wg.kept_sums() == [[float(N)], [2.0 * N]]
    assert float(t.sum()) == 0.0


@pytest.mark.timeout(120)
def test_every_rank_owns_a_dataproto_sent_to_all(wg: WorkerGroup) -> None:
    data = DataProto(
        batch=TensorDict({"x": torch.zeros(4, N // 4)}, batch_size=[4]),
        non_tensor_batch={"y": np.zeros(4 * N // 4, dtype=np.float64).reshape(4, -1)},
    )
    wg.keep_and_bump_proto(data)
    assert wg.kept_sums() == [[float(N), float(N)], [2.0 * N, 2.0 * N]]
    assert float(data.batch["x"].sum()) == 0.0 and float(data.non_tensor_batch["y"].sum()) == 0.0


@pytest.mark.timeout(120)
def test_a_result_written_by_the_controller_does_not_leak_into_later_results(
    wg: WorkerGroup,
) -> None:
    # The worker reuses its segment for the next result once the controller
    # dropped the previous one; what the controller wrote must not show through.
    for i in range(6):
        results = wg.make(float(i))
        assert [float(r.sum()) for r in results] == [float(i) * N] * 2
        for r in results:
            r.add_(100.0)
        del results
