"""The data plane inside each rank: where exported shards live and how peers read them.

A method registered with ``output="ref"`` keeps its output in the rank that
made it (an *export*); the controller gets a :class:`ShardInfo` -- metadata
only -- and wraps it in a :class:`podium.BatchRef`. A rank that receives a
``BatchRef`` as an argument reads exactly its rows and keys from the ranks
that hold them (:func:`fetch`) and its method gets an ordinary ``DataProto``.

The pieces:

- :class:`Layout`: how one shard's tensors lie in one flat byte buffer (each
  key a ``[rows, row_bytes]`` block), so a reader can take any rows of any key
  without decoding the rest; non-tensor columns are one pickled blob.
- :class:`ShardStore`: the shards one worker (one :class:`~podium.core.host.WorkerHost`)
  exported, by id, until the controller releases them or the worker closes.
- :class:`Exporter` / :class:`Transport`: the backend's part. The exporter
  places a shard where peers can read it (Ray: ``ray.put``; torchrun: a
  shared-memory segment; inline: nothing, the shard is the object) and
  returns a picklable transport that reads it back anywhere. A process
  without an exporter returns outputs by value, and the controller holds them
  (the fallback for backends without ``capabilities.batch_refs``).

A reader in the process that exported the shard (a colocated role on the same
worker) gets the stored tensors themselves, without a copy. Every other read
goes through the transport; a producer that is gone is a
:class:`podium.errors.DataLostError`.
"""

from __future__ import annotations

import contextvars
import mmap
import pickle
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from podium.core._batch_utils import Key, leaves
from podium.core.protocol import DataProto
from podium.errors import DataLostError

__all__ = [
    "RELEASE",
    "RowReference",
    "Exporter",
    "Layout",
    "ShardInfo",
    "ShardStore",
    "Transport",
    "fetch",
    "held_shards",
    "read_joined",
    "set_exporter",
    "transfer_stats",
]

# Built-in target: frees shards of this worker's store (``__podium_release__(ids)``).
RELEASE = "__podium_release__"
_ALIGN = 64
_PAGE = mmap.PAGESIZE


# -- layout ------------------------------------------------------------------


class RowReference:
    """Base of handles to rows that stay in the ranks holding them (:class:`podium.BatchRef`).

    The layers below the handle's own module test for it with ``isinstance``:
    :func:`podium.get` materializes one, a rank reads one's rows with :func:`fetch`.
    """

    __slots__ = ()

    def materialize(self, timeout: float | None = None) -> DataProto | TensorDict:
        raise NotImplementedError


@dataclass(frozen=True)
class Column:
    """One tensor key: rows of ``row_bytes`` bytes each, starting at ``offset``."""

    key: Key
    dtype: torch.dtype
    row_shape: tuple[int, ...]
    offset: int
    row_bytes: int


@dataclass(frozen=True)
class Layout:
    """Where each key of one shard lies in its flat buffer of ``nbytes`` bytes."""

    nrows: int
    columns: tuple[Column, ...]
    objects: tuple[str, ...]
    objects_span: tuple[int, int]  # (offset, nbytes) of the pickled non-tensor columns
    nbytes: int
    kind: str  # "dataproto" or "tensordict": what a reader gets back

    def __reduce__(self) -> Any:
        # Flat tuples and dtype names: a BatchRef crosses with every call, keep it cheap to pickle.
        cols = tuple(
            (c.key, str(c.dtype)[6:], c.row_shape, c.offset, c.row_bytes) for c in self.columns
        )
        return (
            _layout,
            (self.nrows, cols, self.objects, self.objects_span, self.nbytes, self.kind),
        )

    def column(self, key: Key) -> Column:
        for col in self.columns:
            if col.key == key:
                return col
        raise KeyError(key)


def _layout(
    nrows: int,
    cols: tuple[tuple[Any, str, tuple[int, ...], int, int], ...],
    objects: tuple[str, ...],
    span: tuple[int, int],
    nbytes: int,
    kind: str,
) -> Layout:
    columns = tuple(Column(k, getattr(torch, d), shape, off, rb) for k, d, shape, off, rb in cols)
    return Layout(nrows, columns, objects, span, nbytes, kind)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _tensors_of(
    data: DataProto | TensorDictBase,
) -> tuple[dict[Key, torch.Tensor], dict[str, np.ndarray], int]:
    if isinstance(data, DataProto):
        batch = data.batch
        objects = dict(data.non_tensor_batch)
        n = len(data)
    else:
        batch = data
        objects = {}
        n = int(data.batch_size[0]) if data.batch_dims else 0
    tensors: dict[Key, torch.Tensor] = {}
    if batch is not None:
        for key, value in leaves(batch).items():
            if (
                not isinstance(value, torch.Tensor)
                or value.is_nested
                or value.layout != torch.strided
            ):
                raise TypeError(
                    f"output='ref': key {key!r} holds a {type(value).__name__}; only dense tensors "
                    "and non_tensor_batch arrays can be kept in a rank (return it by value instead)"
                )
            tensors[key] = value
    return tensors, objects, n


def plan(data: DataProto | TensorDictBase) -> tuple[Layout, Callable[[np.ndarray], None]]:
    """The layout of ``data`` and a function that writes it into a buffer of ``layout.nbytes``."""
    tensors, objects, n = _tensors_of(data)
    columns = []
    offset = 0
    for key, t in tensors.items():
        row_shape = tuple(t.shape[1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * t.element_size()
        if row_bytes and row_bytes % _PAGE == 0:
            # Whole-page rows on a page boundary: a reader can map rows of several shards
            # side by side instead of copying them together (Transport.read_joined).
            offset = (offset + _PAGE - 1) // _PAGE * _PAGE
        columns.append(Column(key, t.dtype, row_shape, offset, row_bytes))
        offset = _align(offset + n * row_bytes)
    blob = pickle.dumps(objects, protocol=5) if objects else b""
    span = (offset, len(blob))
    layout = Layout(
        n,
        tuple(columns),
        tuple(objects),
        span,
        _align(offset + len(blob)),
        "dataproto" if isinstance(data, DataProto) else "tensordict",
    )

    def write(buf: np.ndarray) -> None:
        for col in columns:
            t = tensors[col.key].detach()
            if t.device.type != "cpu":
                t = t.cpu()
            nbytes = n * col.row_bytes
            if nbytes:
                flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                buf[col.offset : col.offset + nbytes] = flat
        if blob:
            buf[span[0] : span[0] + span[1]] = np.frombuffer(blob, dtype=np.uint8)

    return layout, write


def _rows_slice(rows: np.ndarray) -> slice | None:
    """``rows`` as a slice when they are consecutive (a view is then possible)."""
    if rows.size == 0:
        return slice(0, 0)
    start = int(rows[0])
    if rows.size == 1:
        return slice(start, start + 1)
    if rows[-1] - start == rows.size - 1 and np.all(np.diff(rows) == 1):
        return slice(start, start + int(rows.size))
    return None


def read_buffer(
    layout: Layout,
    buf: np.ndarray,
    rows: np.ndarray,
    keys: Sequence[Key],
    objects: Sequence[str],
    meta_info: dict[str, Any],
    *,
    writable: bool,
) -> DataProto | TensorDict:
    """Rows ``rows`` of ``keys`` (and non-tensor ``objects``) from a shard's buffer.

    Consecutive rows of a ``writable`` buffer are views (no copy); other rows,
    and every row of a read-only buffer, are copied -- only those rows.
    """
    m = int(rows.size)
    sl = _rows_slice(rows)
    tensors: dict[Key, torch.Tensor] = {}
    for key in keys:
        col = layout.column(key)
        if col.row_bytes == 0:
            tensors[key] = torch.empty((m, *col.row_shape), dtype=col.dtype)
            continue
        block = buf[col.offset : col.offset + layout.nrows * col.row_bytes].reshape(
            layout.nrows, col.row_bytes
        )
        part = block[sl] if sl is not None else block[rows]
        if sl is not None and not writable:
            part = np.array(part)
        tensors[key] = torch.from_numpy(part).view(col.dtype).reshape(m, *col.row_shape)
    non_tensors: dict[str, np.ndarray] = {}
    if objects:
        off, nbytes = layout.objects_span
        stored = pickle.loads(buf[off : off + nbytes].tobytes())
        index: slice | np.ndarray = sl if sl is not None else rows
        non_tensors = {k: stored[k][index].copy() for k in objects}
    return _build(layout.kind, tensors, non_tensors, m, meta_info)


def _build(
    kind: str,
    tensors: dict[Key, torch.Tensor],
    non_tensors: dict[str, np.ndarray],
    n: int,
    meta_info: dict[str, Any],
) -> DataProto | TensorDict:
    if all(isinstance(k, str) for k in tensors):
        td = TensorDict(tensors, batch_size=[n])
    else:
        td = TensorDict({}, batch_size=[n])
        for key, value in tensors.items():
            td.set(key, value)
    if kind == "tensordict":
        return td
    batch = td if tensors or not non_tensors else None
    return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(meta_info))


def read_local(
    data: DataProto | TensorDictBase,
    rows: np.ndarray,
    keys: Sequence[Key],
    objects: Sequence[str],
    meta_info: dict[str, Any],
    *,
    copy: bool,
) -> DataProto | TensorDict:
    """The same rows and keys from a shard kept as an object (views unless rows are scattered or ``copy``)."""
    tensors, stored, n = _tensors_of(data)
    sl = _rows_slice(rows)
    index: slice | torch.Tensor = sl if sl is not None else torch.from_numpy(rows)
    out: dict[Key, torch.Tensor] = {}
    for key in keys:
        t = tensors[key]
        if sl is None or sl != slice(0, n):
            t = t[index]
        out[key] = t.clone() if copy else t
    np_index: slice | np.ndarray = sl if sl is not None else rows
    non_tensors = {
        k: (stored[k][np_index].copy() if copy else stored[k][np_index]) for k in objects
    }
    kind = "dataproto" if isinstance(data, DataProto) else "tensordict"
    return _build(kind, out, non_tensors, int(rows.size), meta_info)


# -- exports -------------------------------------------------------------------


class Transport:
    """How any process reads one exported shard back. Picklable; made by an :class:`Exporter`.

    ``read`` returns the rows and keys asked for, or raises
    :class:`podium.errors.DataLostError` when the shard's producer is gone.
    A transport with ``reads_views = True`` also takes ``read(..., copy=False)``,
    which may return read-only views of where the shard lies: its readers pass
    it when they join the rows of several shards, which copies them anyway.
    """

    reads_views = False

    def read(
        self,
        info: ShardInfo,
        rows: np.ndarray,
        keys: Sequence[Key],
        objects: Sequence[str],
        meta_info: dict[str, Any],
    ) -> DataProto | TensorDict:
        raise NotImplementedError

    @classmethod
    def read_joined(
        cls,
        pieces: Sequence[tuple[ShardInfo, np.ndarray]],
        keys: Sequence[Key],
        objects: Sequence[str],
        meta_info: dict[str, Any],
    ) -> DataProto | TensorDict | None:
        """The rows of several shards in order, as one batch, without copying them together.

        ``pieces``: ``(info, rows)`` per run, rows consecutive within their
        shard, every transport of this class. None (the default) when this
        transport cannot; the reader then reads each piece and joins them.
        """
        return None

    def drop(self) -> None:
        """Forget what this copy holds (the controller released the shard)."""


class Exporter:
    """A backend's way to place a shard where peers can read it (one per worker process)."""

    def export(
        self,
        shard_id: str,
        data: DataProto | TensorDictBase,
        layout: Layout,
        write: Callable[[np.ndarray], None],
    ) -> tuple[Transport, Any, DataProto | TensorDictBase]:
        """``(transport, handle, local)``: how peers read it, what :meth:`free` frees, what this process keeps."""
        raise NotImplementedError

    def free(self, handle: Any) -> None:
        """Free what :meth:`export` placed (the last reference to the shard is gone)."""


@dataclass
class ShardInfo:
    """What the controller learns about one rank's exported output (no tensor bytes)."""

    def __reduce__(self) -> Any:
        return (
            ShardInfo,
            (
                self.shard_id,
                self.store,
                self.layout,
                self.transport,
                self.meta_info,
                self.row_meta,
                self.auto_padding,
            ),
        )

    shard_id: str
    store: str
    layout: Layout
    transport: Transport
    meta_info: dict[str, Any] = field(default_factory=dict)
    row_meta: dict[str, np.ndarray] = field(default_factory=dict)
    auto_padding: bool = False


@dataclass
class _Entry:
    data: DataProto | TensorDictBase | None
    handle: Any
    nbytes: int
    exporter: Exporter


_stores: dict[str, ShardStore] = {}
_stores_lock = threading.Lock()


class ShardStore:
    """The shards one worker exported, until released or the worker closes."""

    def __init__(self) -> None:
        self.uid = uuid.uuid4().hex
        # This worker's exporter; None: the process's (see set_exporter).
        self.exporter: Exporter | None = None
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        with _stores_lock:
            _stores[self.uid] = self

    def export(
        self, data: Any, row_meta: Sequence[str], method: str
    ) -> ShardInfo | DataProto | TensorDictBase:
        """Keep ``data`` here and describe it; by value when this process has no exporter."""
        if not isinstance(data, (DataProto, TensorDictBase)):
            raise TypeError(
                f"{method} is registered with output='ref' but returned a {type(data).__name__}; "
                "it must return a DataProto or a TensorDict"
            )
        exporter = self.exporter if self.exporter is not None else _exporter
        if exporter is None:
            return data
        published = publish_row_meta(data, row_meta, method)
        layout, write = plan(data)
        shard_id = uuid.uuid4().hex
        transport, handle, local = exporter.export(shard_id, data, layout, write)
        with self._lock:
            self._entries[shard_id] = _Entry(local, handle, layout.nbytes, exporter)
        meta = dict(data.meta_info) if isinstance(data, DataProto) else {}
        auto = bool(getattr(data, "auto_padding", False))
        return ShardInfo(shard_id, self.uid, layout, transport, meta, published, auto)

    def get(self, shard_id: str) -> DataProto | TensorDictBase | None:
        with self._lock:
            entry = self._entries.get(shard_id)
        return entry.data if entry is not None else None

    def release(self, shard_ids: Sequence[str]) -> int:
        """Free the named shards (unknown ids are ignored); how many were held."""
        with self._lock:
            entries = [self._entries.pop(s) for s in shard_ids if s in self._entries]
        count = len(entries)
        while entries:
            entry = entries.pop()
            handle, exporter = entry.handle, entry.exporter
            entry.data = None  # the last reference to the kept tensors: their memory can go
            del entry
            exporter.free(handle)
        return count

    @property
    def shard_count(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        with self._lock:
            ids = list(self._entries)
        self.release(ids)
        with _stores_lock:
            _stores.pop(self.uid, None)


def held_shards() -> dict[str, int]:
    """The shards the workers of this process hold now, and their bytes."""
    with _stores_lock:
        stores = list(_stores.values())
    count = nbytes = 0
    for store in stores:
        with store._lock:
            count += len(store._entries)
            nbytes += sum(e.nbytes for e in store._entries.values())
    return {"shards": count, "bytes": nbytes}


def held_data_ptrs() -> set[int]:
    """Addresses of the tensors the shards of this process hold (to check that a read did not copy)."""
    with _stores_lock:
        stores = list(_stores.values())
    ptrs: set[int] = set()
    for store in stores:
        with store._lock:
            for entry in store._entries.values():
                if entry.data is None:
                    continue
                tensors, _, _ = _tensors_of(entry.data)
                ptrs.update(t.data_ptr() for t in tensors.values())
    return ptrs


def find_store(uid: str) -> ShardStore | None:
    with _stores_lock:
        return _stores.get(uid)


def publish_row_meta(
    data: DataProto | TensorDictBase, names: Sequence[str], method: str
) -> dict[str, np.ndarray]:
    """The 1-D ``names`` of an output, one value per row, as ``BatchRef.row_meta`` holds them."""
    out: dict[str, np.ndarray] = {}
    for name in names:
        value: Any
        if isinstance(data, DataProto) and name in data.non_tensor_batch:
            value = data.non_tensor_batch[name]
        else:
            batch = data.batch if isinstance(data, DataProto) else data
            if batch is None or name not in batch.keys():
                raise KeyError(f"{method}: row_meta key {name!r} is not in the output")
            value = batch.get(name).detach().cpu().numpy()
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(
                f"{method}: row_meta key {name!r} must hold one value per row (1-D), got shape {arr.shape}"
            )
        out[name] = arr.copy()
    return out


_exporter: Exporter | None = None


def set_exporter(exporter: Exporter | None) -> None:
    """Set this process's exporter (a backend does this in each worker process it starts)."""
    global _exporter
    _exporter = exporter


class InlineTransport(Transport):
    """The shard is the object, in a store of this very process."""

    def __init__(self, store: str, shard_id: str) -> None:
        self.store = store
        self.shard_id = shard_id

    def read(
        self,
        info: ShardInfo,
        rows: np.ndarray,
        keys: Sequence[Key],
        objects: Sequence[str],
        meta_info: dict[str, Any],
    ) -> DataProto | TensorDict:
        store = find_store(self.store)
        data = store.get(self.shard_id) if store is not None else None
        if data is None:
            raise DataLostError(self.shard_id, None, detail="its worker stopped or released it")
        # Another rank: a copy, as if the rows had crossed a process boundary.
        return read_local(data, rows, keys, objects, meta_info, copy=True)


class InlineExporter(Exporter):
    def export(
        self,
        shard_id: str,
        data: DataProto | TensorDictBase,
        layout: Layout,
        write: Callable[[np.ndarray], None],
    ) -> tuple[Transport, Any, DataProto | TensorDictBase]:
        store = _current_store.get()
        if store is None:
            raise RuntimeError("an inline export runs only inside a worker call")
        return InlineTransport(store.uid, shard_id), None, data


# -- reading a BatchRef in a rank -----------------------------------------------

_current_store: contextvars.ContextVar[ShardStore | None] = contextvars.ContextVar(
    "podium_current_store", default=None
)
_stats_lock = threading.Lock()
_stats = {"fetched_bytes": 0, "fetches": 0, "local_reads": 0}


def transfer_stats(reset: bool = False) -> dict[str, int]:
    """This process's data-plane counters: bytes read from other ranks, reads, reads without a copy."""
    with _stats_lock:
        out = dict(_stats)
        if reset:
            for k in _stats:
                _stats[k] = 0
    return out


def read_rows(
    ref: Any,
    shard: int,
    rows: np.ndarray,
    keys: Sequence[Key],
    objects: Sequence[str],
    copy: bool = True,
) -> Any:
    """Rows of one shard: the stored object when this process holds it, else through its transport.

    ``copy=False``: the caller copies the rows itself (it joins several shards' rows).
    """
    info = ref._shards[shard].info
    store = _current_store.get()
    local = store.get(info.shard_id) if store is not None and store.uid == info.store else None
    if local is not None:
        with _stats_lock:
            _stats["local_reads"] += 1
        return read_local(local, rows, keys, objects, ref.meta_info, copy=False)
    try:
        part = read_transport(info, rows, keys, objects, ref.meta_info, copy)
    except DataLostError as exc:  # name the reference and the producer rank
        raise DataLostError(ref.ref_id, ref._shards[shard].rank, detail=lost_detail(exc)) from None
    with _stats_lock:
        _stats["fetches"] += 1
        # The tensor bytes of the rows read (from the layout: no walk over the result).
        _stats["fetched_bytes"] += int(rows.size) * sum(info.layout.column(k).row_bytes for k in keys)
    return part


def read_joined(
    ref: Any, runs: Sequence[tuple[int, np.ndarray]], keys: Sequence[Key], objects: Sequence[str]
) -> DataProto | TensorDict | None:
    """Runs ``(shard, consecutive rows)`` of ``ref`` as one batch through their transport's
    :meth:`Transport.read_joined`; None when it cannot (or a shard is here, or gone)."""
    store = _current_store.get()
    pieces = []
    for shard, rows in runs:
        handle = ref._shards[shard]
        if handle.released or (store is not None and store.uid == handle.info.store):
            return None
        pieces.append((handle.info, rows))
    cls = type(pieces[0][0].transport)
    if any(type(info.transport) is not cls for info, _ in pieces):
        return None
    try:
        out = cls.read_joined(pieces, keys, objects, ref.meta_info)
    except DataLostError:
        return None  # the piecewise read names the producer that is gone
    if out is not None:
        nbytes = sum(
            int(rows.size) * info.layout.column(k).row_bytes for info, rows in pieces for k in keys
        )
        with _stats_lock:
            _stats["fetches"] += len(pieces)
            _stats["fetched_bytes"] += nbytes
    return out


def read_transport(
    info: ShardInfo,
    rows: np.ndarray,
    keys: Sequence[Key],
    objects: Sequence[str],
    meta_info: dict[str, Any],
    copy: bool,
) -> DataProto | TensorDict:
    """``info.transport.read``; views where the transport has them and ``copy`` is False."""
    transport = info.transport
    if not copy and transport.reads_views:
        return transport.read(info, rows, keys, objects, meta_info, copy=False)  # type: ignore[call-arg]
    return transport.read(info, rows, keys, objects, meta_info)


def lost_detail(exc: BaseException) -> str:
    text = str(exc)
    return text.split(" is lost: ", 1)[-1].rsplit(". Recompute", 1)[0]


def fetch(ref: Any) -> DataProto | TensorDict:
    """The rows and keys ``ref`` names, read from the ranks that hold them (see :meth:`BatchRef.materialize`)."""
    return ref._assemble(read_rows, read_joined)


def run_in_store(store: ShardStore) -> contextvars.Token[ShardStore | None]:
    return _current_store.set(store)


def leave_store(token: contextvars.Token[ShardStore | None]) -> None:
    _current_store.reset(token)
