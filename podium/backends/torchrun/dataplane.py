"""The data plane on torchrun: an exported shard is one shared-memory segment of its producer.

The producer writes the shard's flat buffer (see
:class:`podium.core.dataplane.Layout`) once into a ``/dev/shm`` segment named
with its rank's prefix, and keeps tensors that are views of that segment (so
the shard costs its memory once). How a reader gets the rows it needs:

- **on the producer's host**: it maps the segment copy-on-write
  (``MAP_PRIVATE``) and builds its tensors on the mapping: consecutive rows are
  read without a copy, and a reader never sees another reader's writes. The
  mapping is kept for the next read of the same segment, and rows of several
  segments that a reader needs as one tensor are mapped side by side when
  they are whole pages (see :mod:`.mappings`); a shard of at most
  ``SMALL_SHARD`` bytes is copied instead.
- **on another host**: it asks the producer's shard server
  (:mod:`.shardserver`, CURVE-authenticated: only ranks of this controller's
  groups, and the controller, may read) for exactly its rows and keys, sliced
  at the producer. The ``shard_network`` backend option makes readers take
  this path on the producer's host too (tests, benchmarks).

The controller never touches the bytes, except in ``materialize()``. When the
controller releases a shard its segment is renamed at once (a reader that
comes later finds it gone) and kept for a later export of this rank: a fresh
segment costs its page allocation and faults again (~6x a copy into a warm
one), so a chain that exports every step reuses the same pages. A segment is
reused only when nobody can see it any more: this process holds no tensor on
it (a weak reference says so), and no reader on this host reads it -- a reader
holds a shared ``flock`` on the segment for as long as its tensors on it live, and
the producer takes the segment back only if an exclusive ``flock`` succeeds.
Free segments beyond the rank's shared-memory budget, or idle too long, are
removed. Segments are removed when the worker stops, and -- by the rank's
supervisor, within milliseconds -- when the worker dies; a reader that finds
one gone, or a shard server that refuses connections or drops them, raises
:class:`podium.errors.DataLostError`.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from podium.backends.torchrun.mappings import PAGE, shared_reads
from podium.backends.torchrun.shm import (
    _MIN_SEGMENT,
    MAX_FREE_BYTES,
    MAX_IDLE_S,
    SHM_DIR,
    KeepBudget,
    Segment,
)
from podium.core._batch_utils import Key
from podium.core.dataplane import (
    Column,
    Exporter,
    Layout,
    ShardInfo,
    Transport,
    _build,
    read_buffer,
)
from podium.core.protocol import DataProto
from podium.errors import DataLostError, PodiumError

__all__ = ["NETWORK_ENV", "ShmExporter", "ShmTransport"]

# Set to "1" in a process whose reads must go through the producers' shard servers
# even on the producer's host (the ``shard_network`` backend option sets it in workers).
NETWORK_ENV = "PODIUM_TR_SHARD_NETWORK"
# A shard this small is read by copying it whole (one pread) rather than mapped.
SMALL_SHARD = 256 << 10
# Rows of several segments joined for a reader are mapped side by side (no copy) above this size.
JOIN_MAP_MIN = SMALL_SHARD


class ShmTransport(Transport):
    """A shard's segment (name, host, size) and its producer's shard server (endpoint, public key)."""

    def __init__(
        self, name: str, host: str, nbytes: int, endpoint: str = "", server_key: bytes = b""
    ) -> None:
        self.name = name
        self.host = host
        self.nbytes = nbytes
        self.endpoint = endpoint
        self.server_key = server_key
        self.released = False

    def __reduce__(self) -> Any:
        return (ShmTransport, (self.name, self.host, self.nbytes, self.endpoint, self.server_key))

    def read(
        self,
        info: ShardInfo,
        rows: np.ndarray,
        keys: Sequence[Key],
        objects: Sequence[str],
        meta_info: dict[str, Any],
    ) -> DataProto | TensorDict:
        if self.released:
            raise DataLostError(info.shard_id, None, detail="it was released (release())")
        here = self.host == _HOST and os.environ.get(NETWORK_ENV) != "1"
        if not here:
            if not self.endpoint:
                raise PodiumError(
                    f"a BatchRef's rows live in shared memory on host {self.host!r}, whose worker "
                    f"serves no shard server, and cannot be read on {socket.gethostname()!r}: "
                    "materialize() it at the controller"
                )
            from podium.backends.torchrun.shardserver import fetch_remote

            return fetch_remote(
                self.endpoint,
                self.server_key,
                info.shard_id,
                self.name,
                info.layout,
                rows,
                keys,
                objects,
                meta_info,
            )
        if info.layout.nbytes <= SMALL_SHARD:
            # A copy under the lock: cheaper than a mapping, and nothing to unlock later.
            fd = _open_locked(self.name)
            if fd is None:
                raise _gone(info)
            try:
                copy = bytearray(info.layout.nbytes)
                complete = os.preadv(fd, [copy], 0) == len(copy)
            finally:
                os.close(fd)
            if not complete:
                raise _gone(info)
            buf = np.frombuffer(copy, dtype=np.uint8)
        else:
            mapped = shared_reads().read([(self.name, 0, self.nbytes)])
            if mapped is None:
                raise _gone(info)
            buf = mapped
        return read_buffer(info.layout, buf, rows, keys, objects, meta_info, writable=True)

    @classmethod
    def read_joined(
        cls,
        pieces: Sequence[tuple[ShardInfo, np.ndarray]],
        keys: Sequence[Key],
        objects: Sequence[str],
        meta_info: dict[str, Any],
    ) -> DataProto | TensorDict | None:
        """Runs of consecutive rows of segments on this host, each key's runs mapped back to back.

        Keys whose rows are whole pages (``row_bytes`` a multiple of the page
        size, in a page-aligned column: see :func:`podium.core.dataplane.plan`)
        are mapped; the other keys and the non-tensor columns are read piece
        by piece and copied together (small, as rows of a few bytes are).
        None when no key can be mapped, when the mapped bytes are too few
        for a mapping to beat a copy, or when a segment is gone (the
        caller's piecewise read then reports it).
        """
        ts = [info.transport for info, _ in pieces]
        here = [t for t in ts if isinstance(t, ShmTransport) and not t.released and t.host == _HOST]
        if len(here) < len(ts) or os.environ.get(NETWORK_ENV) == "1":
            return None
        m = sum(int(rows.size) for _, rows in pieces)
        ranges: list[tuple[str, int, int]] = []  # (segment, offset, nbytes)
        mapped: list[tuple[Key, Column]] = []
        for key in keys:
            cols = [info.layout.column(key) for info, _ in pieces]
            first = cols[0]
            if first.row_bytes == 0 or any(
                c.row_bytes % PAGE
                or c.offset % PAGE
                or (c.dtype, c.row_shape) != (first.dtype, first.row_shape)
                for c in cols
            ):
                continue
            mapped.append((key, first))
            for t, c, (_, rows) in zip(here, cols, pieces):
                start, count = c.offset + int(rows[0]) * c.row_bytes, int(rows.size) * c.row_bytes
                ranges.append((t.name, start, count))
        if sum(n for _, _, n in ranges) <= JOIN_MAP_MIN:
            return None
        buf = shared_reads().read(ranges)
        if buf is None:
            return None
        tensors: dict[Key, torch.Tensor] = {}
        at = 0
        for key, col in mapped:
            nbytes = m * col.row_bytes
            view = torch.from_numpy(buf[at : at + nbytes])
            tensors[key] = view.view(col.dtype).reshape(m, *col.row_shape)
            at += nbytes
        rest = [k for k in keys if k not in tensors]
        non_tensors: dict[str, np.ndarray] = {}
        if rest or objects:
            parts = [
                t.read(info, rows, rest, objects, meta_info)
                for t, (info, rows) in zip(here, pieces)
            ]
            batches = [p.batch if isinstance(p, DataProto) else p for p in parts]
            for key in rest:
                tensors[key] = torch.cat([b.get(key) for b in batches if b is not None])
            for k in objects:
                non_tensors[k] = np.concatenate(
                    [p.non_tensor_batch[k] for p in parts if isinstance(p, DataProto)]
                )
        ordered = {key: tensors[key] for key in keys}
        return _build(pieces[0][0].layout.kind, ordered, non_tensors, m, meta_info)

    def drop(self) -> None:
        self.released = True


_HOST = socket.gethostname()


def _gone(info: ShardInfo) -> DataLostError:
    detail = "its producer's shared memory is gone (released, or the worker ended)"
    return DataLostError(info.shard_id, None, detail=detail)


def _open_locked(name: str) -> int | None:
    """A descriptor of segment ``name`` holding its shared lock, or None when it is gone.

    The lock lasts as long as the descriptor: the producer reuses a segment
    only once it can lock it exclusively (see :class:`ShmExporter`).
    """
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
    except BaseException:
        os.close(fd)
        raise
    if not same:  # released (renamed for reuse) between our open and our lock
        os.close(fd)
        return None
    return fd


ServerFactory = Callable[[Callable[[str], "tuple[np.ndarray, Layout] | None"]], Any]


class _Export:
    """One exported shard's segment, and the view this process built its own tensors on."""

    def __init__(self, seg: Segment, buf: np.ndarray) -> None:
        self.seg = seg
        # Every view (and tensor) of this process on the segment holds ``buf``
        # (numpy's views point at it): dead once none is left.
        self.local = weakref.ref(buf)
        self.freed_at = 0.0


class ShmExporter(Exporter):
    """Writes each exported shard into a segment named ``{prefix}x{n}`` (the rank's prefix).

    Freed segments are kept for later exports (see the module docstring) up to
    a :class:`~podium.backends.torchrun.shm.KeepBudget` (``max_free``, or the
    bytes exported at once at the recent peak; the one freed last whatever its
    size) and for ``max_idle`` seconds. With a ``server`` factory, the first export starts this worker's
    shard server (see :mod:`.shardserver`), which serves the segments exported
    here until they are freed.
    """

    def __init__(
        self,
        prefix: str,
        server: ServerFactory | None = None,
        *,
        max_free: int = MAX_FREE_BYTES,
        max_idle: float = MAX_IDLE_S,
    ) -> None:
        self.prefix = prefix
        self.host = socket.gethostname()
        self.max_free = max_free
        self.max_idle = max_idle
        self._count = itertools.count()
        self._server_factory = server
        self._server: Any = None
        self._lock = threading.Lock()
        self._served: dict[str, tuple[np.ndarray, Layout]] = {}
        self._free: list[_Export] = []  # oldest first
        self._budget = KeepBudget(max_free, max_idle)
        self._exported = 0  # bytes of the segments of shards not freed yet
        self.reused = 0  # exports written into a kept segment (tests, benchmarks)

    def _name(self) -> str:
        return f"{self.prefix}x{next(self._count)}"

    def export(
        self,
        shard_id: str,
        data: DataProto | TensorDictBase,
        layout: Layout,
        write: Callable[[np.ndarray], None],
    ) -> tuple[Transport, Any, DataProto | TensorDictBase]:
        size = max(layout.nbytes, mmap.PAGESIZE)
        seg = self._reuse(size)
        if seg is None:
            size += -size % mmap.PAGESIZE
            seg = Segment(self._name(), size)
        buf = np.frombuffer(seg.map, dtype=np.uint8)  # this export's own (see _Export)
        write(buf)
        # Keep views of the segment, not the output: the shard's memory counts once.
        meta = dict(data.meta_info) if isinstance(data, DataProto) else {}
        rows = np.arange(layout.nrows, dtype=np.int64)
        local = read_buffer(
            layout, buf, rows, [c.key for c in layout.columns], layout.objects, meta, writable=True
        )
        if isinstance(local, DataProto) and isinstance(data, DataProto):
            local.auto_padding = data.auto_padding
        handle = _Export(seg, buf)
        with self._lock:
            self._exported += seg.size
            self._budget.in_use(self._exported, time.monotonic())
        endpoint, server_key = "", b""
        server = self._serve()
        if server is not None:
            with self._lock:
                self._served[seg.name] = (buf, layout)
            endpoint, server_key = server.endpoint, server.public_key
        return ShmTransport(seg.name, self.host, seg.size, endpoint, server_key), handle, local

    def _serve(self) -> Any:
        if self._server is None and self._server_factory is not None:
            self._server = self._server_factory(self._lookup)
        return self._server

    def _lookup(self, name: str) -> tuple[np.ndarray, Layout] | None:
        with self._lock:
            return self._served.get(name)

    def _reuse(self, nbytes: int) -> Segment | None:
        """A kept segment of ``nbytes`` to ~2x that nobody sees any more, or None."""
        with self._lock:
            fits = sorted(
                (e for e in self._free if nbytes <= e.seg.size <= max(2 * nbytes, nbytes + _MIN_SEGMENT)),
                key=lambda e: e.seg.size,
            )
            for entry in fits:
                if entry.local() is None and _unseen(entry.seg):
                    self._free.remove(entry)
                    self.reused += 1
                    return entry.seg
        return None

    def free(self, handle: Any) -> None:
        seg = handle.seg
        with self._lock:
            self._served.pop(seg.name, None)
            self._exported -= seg.size
        # A new name at once: a reader with a released BatchRef finds nothing
        # (DataLostError), and the next export names the segment afresh.
        new = self._name()
        try:
            os.rename(os.path.join(SHM_DIR, seg.name), os.path.join(SHM_DIR, new))
        except OSError:
            seg.close()  # removed under us (the supervisor, at shutdown): nothing to keep
            return
        seg.name = new
        handle.freed_at = time.monotonic()
        with self._lock:
            self._free.append(handle)
            gone = self._trim_locked(handle.freed_at)
        for entry in gone:
            entry.seg.close()

    def trim(self) -> None:
        """Remove kept segments idle for ``max_idle`` s, and the oldest beyond ``max_free`` bytes."""
        with self._lock:
            gone = self._trim_locked(time.monotonic())
        for entry in gone:
            entry.seg.close()

    def _trim_locked(self, now: float) -> list[_Export]:
        kept = sum(e.seg.size for e in self._free)
        limit = self._budget.limit(now)
        gone = []
        for i, entry in enumerate(self._free):
            newest = i == len(self._free) - 1
            if now - entry.freed_at >= self.max_idle or (kept > limit and not newest):
                gone.append(entry)
                kept -= entry.seg.size
        for entry in gone:
            self._free.remove(entry)
        return gone

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(e.seg.size for e in self._free)

    def close(self) -> None:
        """Stop the shard server and remove the kept segments (the worker is ending)."""
        with self._lock:
            self._served.clear()
            gone, self._free = self._free, []
        for entry in gone:
            entry.seg.close()
        if self._server is not None:
            self._server.close()


def _unseen(seg: Segment) -> bool:
    """Whether no reader on this host maps ``seg`` (none holds its shared lock)."""
    try:
        fd = os.open(os.path.join(SHM_DIR, seg.name), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the lock: a reader can only come once the segment is exported again
    return True
