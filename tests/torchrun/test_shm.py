"""Shared memory between the controller and its workers: ownership of what is read, and resources."""

from __future__ import annotations

import errno
import glob
import logging
import os
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from podium import ClassWithInitArgs, DataProto, ResourcePool, Worker, WorkerGroup, register
from podium.backends.torchrun import wire
from podium.backends.torchrun.shm import Segment, SegmentMap, SegmentPool, _PageMap, unlink_prefix
from podium.core.decorator import Dispatch

N = 1 << 18  # float32: 1 MiB, through shared memory
PREFIX = "podium-testshm-"


@pytest.fixture
def pool():
    pool = SegmentPool(PREFIX + "c-")
    yield pool
    pool.close()
    unlink_prefix(PREFIX)


def files(prefix: str) -> list[str]:
    return glob.glob(f"/dev/shm/{prefix}*")


# -- one process ----------------------------------------------------------------------


def test_segments_are_sized_to_whole_pages(pool: SegmentPool) -> None:
    seg = pool.acquire((1 << 20) + 1)
    assert seg.size == (1 << 20) + os.sysconf("SC_PAGE_SIZE")
    assert os.path.getsize(f"/dev/shm/{seg.name}") == seg.size


def test_free_segments_beyond_the_budget_are_removed_oldest_first() -> None:
    mib = 1 << 20
    pool = SegmentPool(PREFIX + "c-", max_free=3 * mib)
    try:
        # One at a time, none fitting the last: at most 7 MiB in use at once, so
        # the pool keeps max(3 MiB, 7 MiB) of free segments: the newest.
        segs = []
        for size in (1, 3, 7):
            seg = pool.acquire(size * mib)
            pool.hold(seg)
            pool.release([seg.name])
            segs.append(seg)
        assert pool.free_bytes == 7 * mib
        assert files(PREFIX) == [f"/dev/shm/{segs[-1].name}"]
        big = pool.acquire(8 * mib)  # larger than the budget: still kept for the next message
        pool.hold(big)
        pool.release([big.name])
        assert pool.acquire(8 * mib) is big
    finally:
        pool.close()
        unlink_prefix(PREFIX)


def test_a_pool_keeps_what_it_had_in_use_at_its_recent_peak() -> None:
    mib = 1 << 20
    pool = SegmentPool(PREFIX + "c-", max_free=3 * mib, max_idle=0.5)
    try:
        # A step sends six 1 MiB shards at once (more than max_free): all six
        # are kept, and the next step reuses them instead of making new ones.
        for _ in range(3):
            segs = [pool.acquire(mib) for _ in range(6)]
            for seg in segs:
                pool.hold(seg)
            pool.release([seg.name for seg in segs])
            assert pool.free_bytes == 6 * mib
        assert pool.segment_count == 6
        time.sleep(0.6)  # the workload stopped: the peak ages out with the segments
        pool.trim()
        assert pool.segment_count == 0
    finally:
        pool.close()
        unlink_prefix(PREFIX)


def test_free_segments_unused_for_a_while_are_removed() -> None:
    pool = SegmentPool(PREFIX + "c-", max_idle=0.2)
    try:
        seg = pool.acquire(1 << 20)
        pool.hold(seg)
        pool.release([seg.name])
        assert files(PREFIX) == [f"/dev/shm/{seg.name}"]
        time.sleep(0.3)
        pool.trim()
        assert files(PREFIX) == [] and pool.segment_count == 0
    finally:
        pool.close()
        unlink_prefix(PREFIX)


def test_a_reader_unmaps_segments_their_owner_removed() -> None:
    pool, reader = SegmentPool(PREFIX + "c-", max_idle=0.0), SegmentMap()
    try:
        enc = wire.encode(torch.ones(N))
        desc, _ = wire.place(enc, pool)
        wire.done_placing(enc, pool)
        (t,) = wire.decode_objects([desc], [enc.header], reader)
        name = desc[1]
        reader.trim()
        assert reader.mapped == [name]  # still read here
        del t
        pool.release(reader.take_releases())  # the owner removes it (max_idle 0)
        assert files(PREFIX) == []
        reader.trim()
        assert reader.mapped == []
        with open("/proc/self/maps") as f:
            assert name not in f.read()  # its memory is free, not just its name
    finally:
        reader.close()
        pool.close()
        unlink_prefix(PREFIX)


class _FullPool(SegmentPool):
    """A pool on a /dev/shm with no room left."""

    def acquire(self, nbytes: int) -> Segment:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_shared_memory_falls_back_to_chunked_frames_and_warns_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "_warned_shm_full", False)
    monkeypatch.setattr(wire, "CHUNK_BYTES", 1 << 20)
    caplog.set_level(logging.WARNING, logger="podium.torchrun")
    pool = _FullPool(PREFIX + "c-")
    value = {"a": torch.arange(3 * N // 2, dtype=torch.float32), "b": torch.ones(10)}
    for _ in range(2):
        enc = wire.encode(value)
        desc, frames = wire.place(enc, pool)
        assert max(memoryview(f).nbytes for f in frames) <= 1 << 20  # no frame above the chunk
        (back,) = wire.decode_objects([desc], [bytes(f) for f in frames], SegmentMap())
        assert torch.equal(back["a"], value["a"]) and torch.equal(back["b"], value["b"])
    warnings = [r for r in caplog.records if "shared memory has no room" in r.getMessage()]
    assert len(warnings) == 1 and "--shm-size" in warnings[0].getMessage()


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


class _CountingPageMap(_PageMap):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def written_runs(self, address: int, pages: int) -> list[tuple[int, int]] | None:
        self.reads += 1
        return super().written_runs(address, pages)


def test_a_part_only_read_is_released_without_walking_its_pages(pool: SegmentPool) -> None:
    """Reading a reused segment costs no pagemap walk; a write still gets its pages dropped."""
    reader = SegmentMap()
    reader._pagemap = pagemap = _CountingPageMap()
    try:
        sums, walks = [], []
        for step in range(5):
            enc = wire.encode(torch.full((N,), float(step)))
            desc, _ = wire.place(enc, pool)
            wire.done_placing(enc, pool)
            before = pagemap.reads
            (t,) = wire.decode_objects([desc], [enc.header], reader)
            if step == 2:
                t[:10].add_(1.0)
            sums.append(float(t.sum()))
            del t
            pool.release(reader.take_releases())
            assert len(pool._free) == 1
            walks.append(pagemap.reads - before)
        assert sums == [0.0, N, 2.0 * N + 10, 3.0 * N, 4.0 * N]  # no stale private copy
        # 0: first read maps the pages (faults); 2: a write; 3: the dropped page is mapped
        # again. 1 and 4 read pages already mapped: nothing faulted, nothing to walk.
        assert walks == [1, 0, 1, 1, 0]
    finally:
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
    def huge_pages(self) -> str | None:
        return os.environ.get("THP_MEM_ALLOC_ENABLE")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kept_sums(self) -> list[float]:
        kept = self.kept
        if isinstance(kept, DataProto):
            return [float(kept.batch["x"].sum()), float(kept.non_tensor_batch["y"].sum())]
        return [float(kept.sum())]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def make(self, value: float) -> torch.Tensor:
        return torch.full((N,), value)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def rows_plus(self, data: DataProto, value: float) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] + value})


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


@pytest.mark.timeout(120)
def test_a_collect_maps_the_ranks_large_results_side_by_side(wg: WorkerGroup) -> None:
    from podium.testing.conformance.workers import mapped_file

    x = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)  # 2 MiB, 4 KiB rows
    data = DataProto.from_dict({"x": x})
    first = wg.rows_plus(data, 1.0)
    y = first.batch["y"]
    assert torch.equal(y, x + 1.0)
    # One tensor: its rows of rank 0 lie in rank 0's segment, those of rank 1 in rank 1's.
    assert "/dev/shm/" in str(mapped_file(y.data_ptr()))
    assert "/dev/shm/" in str(mapped_file(y[256].data_ptr()))
    assert mapped_file(y.data_ptr()) != mapped_file(y[256].data_ptr())
    y[0] = -1.0  # the controller's own copy of that page
    second = wg.rows_plus(data, 2.0)  # while the first result lives: other segments
    assert torch.equal(second.batch["y"], x + 2.0)
    assert torch.equal(y[1:], (x + 1.0)[1:]) and bool((y[0] == -1.0).all())
    del first, second, y
    for step in range(3):  # the segments come back; nothing written earlier shows through
        assert torch.equal(wg.rows_plus(data, 3.0 + step).batch["y"], x + 3.0 + step)


@pytest.mark.timeout(180)
def test_a_group_removes_shared_memory_nobody_uses_any_more() -> None:
    group = WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(OwnerWorker),
        backend="torchrun",
        backend_options={"shm_keep_mb": 4, "shm_keep_s": 2},
    )
    try:
        prefix = f"podium-{group._group.gid}-w"  # type: ignore[attr-defined]
        results = [group.make(float(i)) for i in range(12)]  # 12 segments of 1 MiB per rank
        assert len(files(prefix)) >= 24
        del results
        deadline = time.monotonic() + 20
        while (files(prefix) or _mapped_here(prefix)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert files(prefix) == [] and _mapped_here(prefix) == []
        assert group.make(1.0)[0].sum() == N  # and the group goes on
    finally:
        group.shutdown()


def _mapped_here(prefix: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if prefix in line]


def test_workers_put_large_torch_tensors_in_huge_pages(wg: WorkerGroup) -> None:
    """A fresh result tensor every call: 4 KiB page faults would cost more than its bytes."""
    assert wg.huge_pages() == ["1"] * wg.world_size
