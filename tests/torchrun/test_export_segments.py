"""A rank's exported shards (``output="ref"``) reuse their shared memory, and only when nobody sees it.

Real ``/dev/shm`` segments in one process: the producer's ``ShmExporter`` and
readers through ``ShmTransport.read`` (each read opens the segment on its own
descriptor, so its ``flock`` is independent of the producer's, as in another
process).
"""

from __future__ import annotations

import gc
import glob
import os
import time

import numpy as np
import pytest
import torch

from podium import DataProto
from podium.backends.torchrun.dataplane import SMALL_SHARD, ShmExporter
from podium.backends.torchrun.shm import unlink_prefix
from podium.core.dataplane import ShardInfo, plan
from podium.errors import DataLostError

PREFIX = "podium-testexport-"
ROWS, COLS = 64, 2048  # float32: 512 KiB, read through a mapping (see SMALL_SHARD)


@pytest.fixture
def exporter():
    exp = ShmExporter(PREFIX + "w0-")
    yield exp
    exp.close()
    unlink_prefix(PREFIX)


def export(
    exp: ShmExporter, value: float, cols: int = COLS
) -> tuple[ShardInfo, object, DataProto]:
    data = DataProto.from_dict({"x": torch.full((ROWS, cols), value)})
    layout, write = plan(data)
    transport, handle, local = exp.export("shard", data, layout, write)
    return ShardInfo("shard", "store", layout, transport), handle, local  # type: ignore[return-value]


def read(info: ShardInfo, rows: np.ndarray | None = None) -> DataProto:
    rows = np.arange(ROWS) if rows is None else rows
    out = info.transport.read(info, rows, ["x"], [], {})
    assert isinstance(out, DataProto)
    return out


def test_a_freed_segment_is_reused_under_a_new_name(exporter: ShmExporter) -> None:
    info, handle, local = export(exporter, 1.0)
    first = info.transport.name  # type: ignore[attr-defined]
    assert torch.equal(read(info).batch["x"], torch.full((ROWS, COLS), 1.0))
    del local
    gc.collect()
    exporter.free(handle)
    assert not os.path.exists(f"/dev/shm/{first}")  # renamed at once
    info2, handle2, local2 = export(exporter, 2.0)
    assert exporter.reused == 1
    assert info2.transport.name != first  # type: ignore[attr-defined]
    assert torch.equal(read(info2).batch["x"], torch.full((ROWS, COLS), 2.0))
    assert len(glob.glob(f"/dev/shm/{PREFIX}*")) == 1


def test_a_read_of_a_freed_shard_is_data_lost_not_the_next_shard(exporter: ShmExporter) -> None:
    info, handle, local = export(exporter, 1.0)
    del local
    gc.collect()
    exporter.free(handle)
    export(exporter, 2.0)
    assert exporter.reused == 1
    with pytest.raises(DataLostError, match="gone"):
        read(info)


def test_a_segment_a_reader_still_maps_is_not_reused(exporter: ShmExporter) -> None:
    info, handle, local = export(exporter, 1.0)
    held = read(info)  # a consumer keeps its input
    del local
    gc.collect()
    exporter.free(handle)
    export(exporter, 2.0)
    assert exporter.reused == 0  # a fresh segment instead
    assert torch.equal(held.batch["x"], torch.full((ROWS, COLS), 1.0))
    del held
    gc.collect()  # the reader's mapping and its lock are gone
    export(exporter, 3.0)
    assert exporter.reused == 1


def test_a_segment_the_producer_still_uses_is_not_reused(exporter: ShmExporter) -> None:
    info, handle, local = export(exporter, 1.0)
    kept = local.batch["x"][3:5]  # e.g. a colocated role kept part of the shard
    exporter.free(handle)
    export(exporter, 2.0)
    assert exporter.reused == 0
    assert torch.equal(kept, torch.full((2, COLS), 1.0))


def test_a_reader_sees_its_own_writes_only(exporter: ShmExporter) -> None:
    info, _, local = export(exporter, 1.0)
    mine = read(info)
    mine.batch["x"][0] = 7.0
    assert torch.equal(read(info).batch["x"], torch.full((ROWS, COLS), 1.0))
    assert torch.equal(local.batch["x"], torch.full((ROWS, COLS), 1.0))


def test_a_small_shard_is_read_by_copy_and_its_segment_reused_at_once(
    exporter: ShmExporter,
) -> None:
    assert ROWS * 16 * 4 <= SMALL_SHARD
    info, handle, local = export(exporter, 1.0, cols=16)
    held = read(info, np.array([5, 1]))  # kept by the consumer: a copy, no lock held
    assert torch.equal(held.batch["x"], torch.full((2, 16), 1.0))
    del local
    gc.collect()
    exporter.free(handle)
    export(exporter, 2.0, cols=16)
    assert exporter.reused == 1
    assert torch.equal(held.batch["x"], torch.full((2, 16), 1.0))
    held.batch["x"][0] = 5.0  # writable, and its own


def test_kept_segments_beyond_the_budget_or_idle_are_removed() -> None:
    exp = ShmExporter(PREFIX + "w1-", max_free=300 << 10, max_idle=0.3)
    try:
        # One at a time, none fitting the last: the budget is the largest, the newest stays.
        for cols in (1024, 3072, 7168):  # 256 KiB, 768 KiB, 1.75 MiB
            _, handle, _ = export(exp, 1.0, cols=cols)
            gc.collect()
            exp.free(handle)
        assert exp.kept_bytes == ROWS * 7168 * 4
        assert len(glob.glob(f"/dev/shm/{PREFIX}w1-*")) == 1
        time.sleep(0.4)
        exp.trim()
        assert exp.kept_bytes == 0
        assert glob.glob(f"/dev/shm/{PREFIX}w1-*") == []
    finally:
        exp.close()
        unlink_prefix(PREFIX)


def test_a_step_that_exports_more_than_max_free_at_once_reuses_all_of_it() -> None:
    exp = ShmExporter(PREFIX + "w1-", max_free=300 << 10)
    try:
        for step in range(3):
            shards = [export(exp, float(i), cols=1024) for i in range(4)]  # 1 MiB at once
            handles = [handle for _, handle, _ in shards]
            del shards
            gc.collect()
            for handle in handles:
                exp.free(handle)
            assert exp.reused == 4 * step
        assert len(glob.glob(f"/dev/shm/{PREFIX}w1-*")) == 4
    finally:
        exp.close()
        unlink_prefix(PREFIX)


def test_close_removes_the_kept_segments(exporter: ShmExporter) -> None:
    _, handle, _ = export(exporter, 1.0)
    exporter.free(handle)
    assert glob.glob(f"/dev/shm/{PREFIX}*")
    exporter.close()
    assert glob.glob(f"/dev/shm/{PREFIX}*") == []
