"""Readers keep their mappings of exported segments, and map rows of several segments side by side.

Real ``/dev/shm`` segments in one process, as in ``test_export_segments.py``:
two producers' ``ShmExporter`` and a reader's :class:`SharedReads`.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from podium import DataProto
from podium.backends.torchrun.dataplane import ShmExporter, ShmTransport
from podium.backends.torchrun.mappings import PAGE, SharedReads, shared_reads
from podium.backends.torchrun.shm import unlink_prefix
from podium.core.dataplane import ShardInfo, plan
from podium.testing.conformance.workers import mapped_file

PREFIX = "podium-testreads-"
ROWS = 64
PAGE_COLS = PAGE // 4  # float32 rows of one page


@pytest.fixture
def producers():
    exps = [ShmExporter(f"{PREFIX}w{i}-") for i in range(2)]
    yield exps
    for exp in exps:
        exp.close()
    unlink_prefix(PREFIX)


def export(exp: ShmExporter, data: DataProto) -> tuple[ShardInfo, object, DataProto]:
    layout, write = plan(data)
    transport, handle, local = exp.export("shard", data, layout, write)
    return ShardInfo("shard", "store", layout, transport), handle, local  # type: ignore[return-value]


def rows_of(start: float, cols: int = 2 * PAGE_COLS) -> DataProto:
    """Row i holds start + i everywhere."""
    values = torch.arange(ROWS, dtype=torch.float32)[:, None] + start
    return DataProto.from_dict({"x": values.expand(ROWS, cols).contiguous()})


def test_a_second_read_of_a_reused_segment_uses_the_kept_mapping(producers) -> None:
    exp = producers[0]
    reads = shared_reads()
    info, handle, local = export(exp, rows_of(0.0))
    first = info.transport.read(info, np.arange(ROWS), ["x"], [], {})
    first.batch["x"][3] = -1.0  # the reader writes its own copy of that row's pages
    hits = reads.hits
    del first, local
    gc.collect()
    exp.free(handle)
    info2, _, _ = export(exp, rows_of(100.0))
    assert exp.reused == 1  # the same segment, renamed
    second = info2.transport.read(info2, np.arange(ROWS), ["x"], [], {})
    assert reads.hits == hits + 1  # the mapping of the first read, kept
    # The producer's new bytes, also where the first read had written.
    assert torch.equal(second.batch["x"], rows_of(100.0).batch["x"])


def test_a_second_concurrent_read_gets_its_own_mapping(producers) -> None:
    info, _, _ = export(producers[0], rows_of(0.0))
    a = info.transport.read(info, np.arange(ROWS), ["x"], [], {})
    b = info.transport.read(info, np.arange(ROWS), ["x"], [], {})
    a.batch["x"][0] = -1.0
    assert b.batch["x"][0, 0] == 0.0
    assert a.batch["x"].data_ptr() != b.batch["x"].data_ptr()


def joined(infos: list[ShardInfo], runs: list[np.ndarray], keys=("x",)):
    return ShmTransport.read_joined(list(zip(infos, runs)), list(keys), [], {})


def test_rows_of_two_segments_are_mapped_side_by_side_not_copied(producers) -> None:
    (ia, ha, la), (ib, hb, lb) = (
        export(producers[0], rows_of(0.0)),
        export(producers[1], rows_of(1000.0)),
    )
    out = joined([ia, ib], [np.arange(40, 64), np.arange(0, 30)])
    assert out is not None
    x = out.batch["x"]
    want = torch.cat([rows_of(0.0).batch["x"][40:], rows_of(1000.0).batch["x"][:30]])
    assert torch.equal(x, want)
    # One tensor whose first rows lie in the first segment and the rest in the second.
    row = x.stride(0) * 4
    assert str(mapped_file(x.data_ptr())).endswith(ia.transport.name)
    assert str(mapped_file(x.data_ptr() + 24 * row)).endswith(ib.transport.name)
    # While it lives, neither producer may reuse its segment; once it is gone, both can.
    del la, lb
    gc.collect()
    producers[0].free(ha)
    producers[1].free(hb)
    export(producers[0], rows_of(5.0))
    assert producers[0].reused == 0
    assert torch.equal(x, want)
    x[0] = 0.5  # and it is the reader's own
    del out, x
    gc.collect()
    export(producers[1], rows_of(6.0))
    assert producers[1].reused == 1


def test_rows_that_are_not_whole_pages_are_not_mapped_side_by_side(producers) -> None:
    ia, _, _ = export(producers[0], rows_of(0.0, cols=PAGE_COLS + 1))
    ib, _, _ = export(producers[1], rows_of(1.0, cols=PAGE_COLS + 1))
    assert joined([ia, ib], [np.arange(32, 64), np.arange(0, 32)]) is None  # the reader copies


def test_a_column_of_whole_page_rows_starts_on_a_page(producers) -> None:
    data = DataProto.from_dict(
        {"small": torch.ones(ROWS, 3), "x": torch.ones(ROWS, PAGE_COLS), "y": torch.ones(ROWS, 5)}
    )
    layout, _ = plan(data)
    x = layout.column("x")
    assert x.offset == PAGE  # after the small column, on the next page
    assert layout.column("y").offset == x.offset + ROWS * PAGE  # other columns are packed


def test_a_removed_segment_is_unmapped_by_trim(producers) -> None:
    reads = SharedReads()
    info, handle, local = export(producers[0], rows_of(0.0))
    t = info.transport
    inode = os.stat(f"/dev/shm/{t.name}").st_ino
    got = reads.read([(t.name, 0, t.nbytes)])
    assert got is not None and reads.mapped_bytes == t.nbytes
    del got, local
    gc.collect()
    reads.trim()
    assert reads.mapped_bytes == t.nbytes  # still there: kept for the next read
    producers[0].free(handle)
    producers[0].close()  # the producer removes its (renamed) segment
    reads.trim()
    assert reads.mapped_bytes == 0
    assert inode not in _mapped_inodes()
    reads.close()


def _mapped_inodes() -> set[int]:
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f}


def test_a_released_segment_reads_as_gone(producers) -> None:
    reads = SharedReads()
    info, handle, local = export(producers[0], rows_of(0.0))
    name = info.transport.name
    del local
    gc.collect()
    producers[0].free(handle)  # renamed
    assert reads.read([(name, 0, info.transport.nbytes)]) is None
    assert not os.path.exists(f"/dev/shm/{name}")
    reads.close()
