"""``BatchRef``: a batch that stays in the ranks that made it; the controller holds metadata.

A method registered with ``output="ref"`` returns a :class:`BatchRef` instead
of a ``DataProto``. It carries no tensors: the length, the keys, ``meta_info``,
small per-row values the producer published (``row_meta``), and, for every
row, which shard (one producer rank's output) and which row of it holds it.

- Metadata operations move no data: ``select``, indexing and ``reorder``,
  ``chunk``/``split``, ``concat``, ``union``, ``repeat`` and padding only
  rewrite the row index (padding repeats index entries; it writes nothing).
- Passed as the data argument of a DP-mode or nd-mesh method, each rank reads
  exactly its rows and keys from the producers and receives an ordinary
  ``DataProto`` (see :mod:`podium.core.dataplane`).
- :meth:`BatchRef.materialize` (or ``podium.get(ref)``) brings the rows to the
  controller: the only way bytes reach it.
- Lifetime: a producer frees a shard when the last ``BatchRef`` naming it is
  gone at the controller (garbage collection; the release is sent with the
  next call), when :meth:`BatchRef.release` is called (at once), or when its
  group stops. A ``BatchRef`` unpickled elsewhere is a borrowed view: it does
  not keep shards alive.
- A producer that is gone makes every read of its rows a
  :class:`podium.errors.DataLostError`.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from podium.core._batch_utils import Key, normalize_index
from podium.core.batching import register_batch_type
from podium.core.dataplane import (
    RowReference,
    ShardInfo,
    Transport,
    lost_detail,
    plan,
    publish_row_meta,
    read_joined,
    read_local,
    read_transport,
)
from podium.core.protocol import DataProto
from podium.errors import DataLostError

if TYPE_CHECKING:
    from podium.core.backend import BackendGroup

__all__ = [
    "BatchRef",
    "ShardHandle",
    "adopt",
    "flush_releases",
    "keep_inputs",
]

# -- shards and their lifetime ---------------------------------------------------


class ShardHandle:
    """One producer rank's exported output, as the controller sees it.

    Every ``BatchRef`` naming the shard shares this object; when the last one is
    gone the shard is released. ``lease`` exists only at the controller.
    """

    __slots__ = ("__weakref__", "info", "lease", "rank")

    def __init__(self, info: ShardInfo, rank: int, lease: _Lease | None = None) -> None:
        self.info = info
        self.rank = rank
        self.lease = lease

    def __reduce__(self) -> Any:
        # The per-row values travel once, with the BatchRef, not again with each shard.
        info = self.info
        if info.row_meta:
            info = self.info = dataclasses.replace(info, row_meta={})
        return (ShardHandle, (info, self.rank))

    @property
    def released(self) -> bool:
        return self.lease is not None and self.lease.released


class _Lease:
    """The controller's claim on one shard: which group and rank to tell when it is freed."""

    __slots__ = ("group", "group_name", "rank", "released", "shard_id")

    def __init__(self, group: BackendGroup, group_name: str, rank: int, shard_id: str) -> None:
        self.group: weakref.ref[BackendGroup] = weakref.ref(group)
        self.group_name = group_name
        self.rank = rank
        self.shard_id = shard_id
        self.released = False

    def alive_group(self) -> BackendGroup | None:
        group = self.group()
        if group is None or getattr(group, "_podium_closed", False):
            return None
        return group

    def death(self) -> BaseException | None:
        """The producer group's recorded death (backends keep it in ``_dead``), if any."""
        group = self.group()
        return getattr(group, "_dead", None) if group is not None else None


_pending_lock = threading.Lock()
# id(group) -> (weak group, rank -> shard ids to free)
_pending: dict[int, tuple[weakref.ref[Any], dict[int, list[str]]]] = {}


def _queue_release(lease: _Lease) -> None:
    """A shard's last reference is gone: free it with the next call (never from inside the collector)."""
    if lease.released:
        return
    lease.released = True
    group = lease.group()
    if group is None:
        return
    with _pending_lock:
        _, ranks = _pending.setdefault(id(group), (lease.group, {}))
        ranks.setdefault(lease.rank, []).append(lease.shard_id)


def flush_releases(wait: bool = False) -> None:
    """Send the queued releases to their producers (their groups stopped: nothing to do)."""
    if not _pending:  # every call comes here: nothing to import or lock for
        return
    from podium.core.backend import RankCall
    from podium.core.dataplane import RELEASE
    from podium.core.futures import get

    with _pending_lock:
        batches = list(_pending.values())
        _pending.clear()
    futures = []
    for group_ref, ranks in batches:
        group = group_ref()
        if group is None or getattr(group, "_podium_closed", False):
            continue
        calls = [RankCall(rank, (ids,), {}) for rank, ids in sorted(ranks.items())]
        try:
            futures.extend(group.submit(RELEASE, calls))
        except Exception:  # a dead or stopping group frees everything itself
            continue
    if wait and futures:
        for fut in futures:
            try:
                get(fut, 60.0)
            except Exception:  # the producer died: its memory went with it
                pass


def keep_inputs(futures: Sequence[Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Keep the ``BatchRef`` arguments of a non-blocking call alive as long as its futures.

    Their shards are then not released (a dropped reference is freed with the
    next call) before the ranks of this call have read them.
    """
    refs = [a for a in (*args, *kwargs.values()) if isinstance(a, BatchRef)]
    if refs:
        for future in futures:
            future._podium_inputs = refs


def adopt(
    outputs: list[Any],
    group: BackendGroup,
    group_name: str,
    row_meta: Sequence[str] = (),
    method: str = "",
) -> list[Any]:
    """Per-rank outputs of an ``output="ref"`` call, each as a one-shard ``BatchRef``.

    A rank that returned its output by value (a process without an exporter:
    the fallback) gets a ``BatchRef`` whose shard the controller holds, with
    the ``row_meta`` keys published as the rank would have.
    ``None`` (a rank that does not collect) stays ``None``.
    """
    out: list[Any] = []
    for rank, value in enumerate(outputs):
        if isinstance(value, ShardInfo):
            lease = _Lease(group, group_name, rank, value.shard_id)
            handle = ShardHandle(value, rank, lease)
            weakref.finalize(handle, _queue_release, lease)
            out.append(BatchRef._from_shard(handle))
        elif isinstance(value, (DataProto, TensorDict)):
            layout, _ = plan(value)
            meta = dict(value.meta_info) if isinstance(value, DataProto) else {}
            info = ShardInfo(
                uuid.uuid4().hex,
                "controller",
                layout,
                _HeldTransport(value),
                meta,
                publish_row_meta(value, row_meta, method),
                bool(getattr(value, "auto_padding", False)),
            )
            out.append(BatchRef._from_shard(ShardHandle(info, rank)))
        else:
            out.append(value)
    return out


class _HeldTransport(Transport):
    """A shard the controller itself holds (a backend without ``batch_refs``)."""

    held_by_controller = True

    def __init__(self, data: DataProto | TensorDict) -> None:
        self.data: DataProto | TensorDict | None = data

    def read(
        self,
        info: Any,
        rows: np.ndarray,
        keys: Sequence[Key],
        objects: Sequence[str],
        meta_info: dict[str, Any],
    ) -> DataProto | TensorDict:
        if self.data is None:
            raise DataLostError(info.shard_id, None, detail="it was released")
        return read_local(self.data, rows, keys, objects, meta_info, copy=False)

    def drop(self) -> None:
        self.data = None


# -- the reference ---------------------------------------------------------------


class _Part:
    """Keys whose rows come from the same places: ``index[i] = (shard, row)`` of row ``i``."""

    __slots__ = ("index", "keys", "objects")

    def __init__(self, keys: tuple[Key, ...], objects: tuple[str, ...], index: np.ndarray) -> None:
        self.keys = keys
        self.objects = objects
        self.index = index

    def __reduce__(self) -> Any:
        # Rows usually come in long consecutive runs: send (shard, first row, count) per run.
        if len(self.index) < 64:
            return (_Part, (self.keys, self.objects, self.index))
        runs = _runs(self.index)
        if runs.size < self.index.size:
            return (_part_from_runs, (self.keys, self.objects, runs))
        return (_Part, (self.keys, self.objects, self.index))


def _runs(index: np.ndarray) -> np.ndarray:
    """``index`` as ``[k, 3]`` runs of ``(shard, first row, count)`` with consecutive rows."""
    if len(index) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = (np.diff(index[:, 0]) != 0) | (np.diff(index[:, 1]) != 1)
    starts = np.concatenate([[0], np.flatnonzero(breaks) + 1])
    counts = np.diff(np.concatenate([starts, [len(index)]]))
    return np.stack([index[starts, 0], index[starts, 1], counts], axis=1)


def _part_from_runs(keys: tuple[Key, ...], objects: tuple[str, ...], runs: np.ndarray) -> _Part:
    if len(runs) == 0:
        return _Part(keys, objects, np.zeros((0, 2), dtype=np.int64))
    shard = np.repeat(runs[:, 0], runs[:, 2])
    offsets = np.arange(int(runs[:, 2].sum())) - np.repeat(
        np.cumsum(runs[:, 2]) - runs[:, 2], runs[:, 2]
    )
    return _Part(
        keys, objects, np.stack([shard, np.repeat(runs[:, 1], runs[:, 2]) + offsets], axis=1)
    )


class BatchRef(RowReference):
    """A batch held by the ranks that produced it. See the module docstring.

    ``len(ref)``, ``ref.keys()``, ``ref.meta_info`` (a dict, as on ``DataProto``),
    ``ref.row_meta`` (published per-row values, aligned with the rows) and
    ``ref.auto_padding`` (taken from the producer's output; settable) read
    like their ``DataProto`` counterparts.
    """

    def __init__(
        self,
        shards: Sequence[ShardHandle],
        parts: Sequence[_Part],
        length: int,
        meta_info: dict[str, Any],
        row_meta: dict[str, np.ndarray],
        auto_padding: bool = False,
    ) -> None:
        self._shards = tuple(shards)
        self._parts = tuple(parts)
        self._length = length
        self.meta_info = dict(meta_info)
        self.row_meta = dict(row_meta)
        self.auto_padding = auto_padding
        self.ref_id = uuid.uuid4().hex[:12]

    @classmethod
    def _from_shard(cls, handle: ShardHandle) -> BatchRef:
        info = handle.info
        layout = info.layout
        n = layout.nrows
        index = np.stack([np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64)], axis=1)
        part = _Part(tuple(c.key for c in layout.columns), tuple(layout.objects), index)
        return cls([handle], [part], n, info.meta_info, info.row_meta, info.auto_padding)

    def _derive(
        self, parts: Sequence[_Part], length: int, row_meta: dict[str, np.ndarray]
    ) -> BatchRef:
        return BatchRef(self._shards, parts, length, self.meta_info, row_meta, self.auto_padding)

    # -- reading the metadata -------------------------------------------------

    def __len__(self) -> int:
        return self._length

    def keys(self) -> list[Key]:
        """The tensor keys, then the non-tensor keys."""
        return [k for p in self._parts for k in p.keys] + [
            k for p in self._parts for k in p.objects
        ]

    @property
    def batch_keys(self) -> list[Key]:
        return [k for p in self._parts for k in p.keys]

    @property
    def non_tensor_keys(self) -> list[str]:
        return [k for p in self._parts for k in p.objects]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the reference names (counting repeated rows each time)."""
        total = 0
        for part in self._parts:
            for key in part.keys:
                for s in np.unique(part.index[:, 0]):
                    col = self._shards[int(s)].info.layout.column(key)
                    total += col.row_bytes * int(np.count_nonzero(part.index[:, 0] == s))
        return total

    @property
    def producer_ranks(self) -> list[int]:
        used = {int(s) for p in self._parts for s in np.unique(p.index[:, 0])}
        return sorted({self._shards[s].rank for s in used})

    def __repr__(self) -> str:
        return (
            f"<BatchRef {self.ref_id} len={len(self)} keys={self.keys()} "
            f"shards={len(self._shards)} meta_info={sorted(self.meta_info)}>"
        )

    def __reduce__(self) -> Any:
        # Shards unpickle without their leases: a copy elsewhere keeps nothing alive.
        state = (
            self._shards,
            self._parts,
            self._length,
            self.meta_info,
            self.row_meta,
            self.auto_padding,
        )
        return (_rebuild, state)

    # -- metadata operations (no data moves) ----------------------------------

    def select(
        self,
        batch_keys: Sequence[Key] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
    ) -> BatchRef:
        """Only the named keys (``None`` keeps every key of that kind), as ``DataProto.select``."""
        tensor_keys = set(self.batch_keys) if batch_keys is None else set(_key_list(batch_keys))
        object_keys = (
            set(self.non_tensor_keys)
            if non_tensor_batch_keys is None
            else set(_key_list(non_tensor_batch_keys))
        )
        unknown = sorted(
            map(
                str,
                (tensor_keys - set(self.batch_keys)) | (object_keys - set(self.non_tensor_keys)),
            )
        )
        if unknown:
            raise KeyError(f"BatchRef has no key(s) {unknown}; its keys: {self.keys()}")
        parts = []
        for p in self._parts:
            keys = tuple(k for k in p.keys if k in tensor_keys)
            objects = tuple(k for k in p.objects if k in object_keys)
            if keys or objects:
                parts.append(_Part(keys, objects, p.index))
        return self._derive(
            parts or [_Part((), (), self._parts[0].index)], len(self), self.row_meta
        )

    def __getitem__(self, index: Any) -> BatchRef:
        """Rows by slice, index array, LongTensor or boolean mask (an int gives one row)."""
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            n = len(self)
            if not -n <= int(index) < n:
                raise IndexError(f"index {int(index)} is out of range for a BatchRef of length {n}")
            index = [int(index) % n]
        rows = normalize_index(index, len(self))
        if isinstance(rows, slice):
            rows = np.arange(len(self))[rows]
        return self._take(np.asarray(rows, dtype=np.int64))

    def _take(self, rows: np.ndarray) -> BatchRef:
        parts = [_Part(p.keys, p.objects, p.index[rows]) for p in self._parts]
        return self._derive(parts, int(rows.size), {k: v[rows] for k, v in self.row_meta.items()})

    def _used_shards(self) -> list[int]:
        """The shards some row names (padding and slicing leave others unused)."""
        if len(self._shards) == 1:
            return [0]
        return sorted({int(s) for p in self._parts for s in np.unique(p.index[:, 0])})

    def reorder(self, indices: Any) -> None:
        """In place: ``self`` becomes ``self[indices]`` (as ``DataProto.reorder``)."""
        taken = self[indices]
        self._parts, self._length, self.row_meta = taken._parts, taken._length, taken.row_meta

    def chunk(self, chunks: int) -> list[BatchRef]:
        """``chunks`` equal parts; the length must divide (as ``DataProto.chunk``)."""
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        n = len(self)
        if n % chunks:
            raise ValueError(
                f"a BatchRef of length {n} cannot be split into {chunks} equal chunks; pad it "
                "first (pad_to_divisor) or set auto_padding=True for dispatch"
            )
        size = n // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[BatchRef]:
        if not isinstance(split_size, int) or isinstance(split_size, bool) or split_size < 1:
            raise ValueError(f"split_size must be a positive int, got {split_size!r}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> BatchRef:
        rows = np.arange(len(self))
        return self._take(
            np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        )

    def pad_to_divisor(self, divisor: int) -> tuple[BatchRef, int]:
        """Rows repeated from the start until the length divides; index entries only."""
        n = len(self)
        pad = -n % divisor
        if pad == 0:
            return self, 0
        if n == 0:
            raise ValueError("cannot pad an empty BatchRef")
        return self._take(np.concatenate([np.arange(n), np.arange(pad) % n])), pad

    def unpad(self, pad: int) -> BatchRef:
        return self[: len(self) - pad] if pad > 0 else self

    @classmethod
    def concat(cls, refs: Sequence[BatchRef]) -> BatchRef:
        """Rows of every reference, in order; all must have the same keys."""
        refs = list(refs)
        if not refs or not all(isinstance(r, BatchRef) for r in refs):
            raise TypeError("BatchRef.concat needs a non-empty list of BatchRefs")
        first = refs[0]
        keys = (set(first.batch_keys), set(first.non_tensor_keys))
        for i, r in enumerate(refs[1:], 1):
            if (set(r.batch_keys), set(r.non_tensor_keys)) != keys:
                raise ValueError(
                    f"concat: the keys of item {i} {r.keys()} differ from item 0 {first.keys()}"
                )
        shards: list[ShardHandle] = []
        where: dict[int, int] = {}
        for r in refs:
            for h in r._shards:
                if id(h) not in where:
                    where[id(h)] = len(shards)
                    shards.append(h)
        # Per key: the concatenated (shard, row) column, with shard numbers renumbered.
        per_key: dict[tuple[str, Any], np.ndarray] = {}
        for kind, names in (("t", first.batch_keys), ("o", first.non_tensor_keys)):
            for name in names:
                cols = []
                for r in refs:
                    part = r._part_of(name, kind == "o")
                    remap = np.array([where[id(h)] for h in r._shards], dtype=np.int64)
                    cols.append(np.stack([remap[part.index[:, 0]], part.index[:, 1]], axis=1))
                per_key[(kind, name)] = np.concatenate(cols) if cols else np.zeros((0, 2), np.int64)
        parts = _regroup(per_key)
        length = sum(len(r) for r in refs)
        if not parts:
            parts = [_Part((), (), np.zeros((length, 2), dtype=np.int64))]
        meta: dict[str, Any] = {}
        for r in refs:
            for k, v in r.meta_info.items():
                meta.setdefault(k, v)
        shared = set.intersection(*(set(r.row_meta) for r in refs))
        row_meta = {k: np.concatenate([r.row_meta[k] for r in refs]) for k in shared}
        return BatchRef(shards, parts, length, meta, row_meta, first.auto_padding)

    def union(self, other: BatchRef) -> BatchRef:
        """The keys of both (same length); a key in both must name the same rows."""
        if not isinstance(other, BatchRef):
            raise TypeError(f"union needs a BatchRef, got {type(other).__name__}")
        if len(self) != len(other):
            raise ValueError(f"cannot union BatchRefs of length {len(self)} and {len(other)}")
        shards = list(self._shards)
        offset = len(shards)
        shards.extend(other._shards)
        parts = list(self._parts)
        for p in other._parts:
            keys = tuple(k for k in p.keys if k not in self.batch_keys)
            objects = tuple(k for k in p.objects if k not in self.non_tensor_keys)
            for k in (k for k in p.keys if k in self.batch_keys):
                self._same_rows(k, False, other, p)
            for k in (k for k in p.objects if k in self.non_tensor_keys):
                self._same_rows(k, True, other, p)
            if keys or objects:
                parts.append(_Part(keys, objects, p.index + np.array([offset, 0], dtype=np.int64)))
        meta = dict(self.meta_info)
        for k, v in other.meta_info.items():
            meta.setdefault(k, v)
        row_meta = {**other.row_meta, **self.row_meta}
        return BatchRef(shards, parts, len(self), meta, row_meta, self.auto_padding)

    def _same_rows(self, key: Key, is_object: bool, other: BatchRef, theirs: _Part) -> None:
        mine = self._part_of(key, is_object)
        a = [(self._shards[s].info.shard_id, r) for s, r in mine.index.tolist()]
        b = [(other._shards[s].info.shard_id, r) for s, r in theirs.index.tolist()]
        if a != b:
            raise ValueError(f"union: key {key!r} names different rows in the two BatchRefs")

    def _part_of(self, key: Any, is_object: bool) -> _Part:
        for p in self._parts:
            if key in (p.objects if is_object else p.keys):
                return p
        raise KeyError(key)

    # -- data -------------------------------------------------------------------

    def _check_live(self) -> None:
        """Fail fast, at the controller, for rows whose producer group is known to be gone."""
        for s in self._used_shards():
            handle = self._shards[s]
            lease = handle.lease
            if lease is None:
                continue
            if lease.released:
                raise ValueError(
                    f"BatchRef {self.ref_id} names rows that were released (release())"
                )
            if lease.alive_group() is None:
                raise DataLostError(
                    self.ref_id,
                    handle.rank,
                    group=lease.group_name,
                    detail="its group was shut down",
                )
            death = lease.death()
            if death is not None:
                raise DataLostError(
                    self.ref_id, handle.rank, group=lease.group_name, detail=str(death)
                )

    @property
    def held_by_controller(self) -> bool:
        """Whether some of its rows are held by the controller (the fallback path)."""
        return any(getattr(h.info.transport, "held_by_controller", False) for h in self._shards)

    def materialize(self, timeout: float | None = None) -> DataProto | TensorDict:
        """The rows as a ``DataProto`` (or ``TensorDict``) at the controller: the only way bytes reach it."""
        self._check_live()
        return self._assemble(_read_here, read_joined)

    def release(self, wait: bool = False) -> None:
        """Free the producers' memory now, for every reference sharing these shards.

        The release is sent to the producer ranks at once and runs there before
        any later call to them; ``wait=True`` also waits until it ran. Any later
        use of a reference naming these shards raises. Idempotent.
        """
        for handle in self._shards:
            lease = handle.lease
            if lease is not None and not lease.released:
                _queue_release(lease)
                handle.info.transport.drop()
        flush_releases(wait=wait)

    def _assemble(self, read: Callable[..., Any], join: Callable[..., Any] | None = None) -> Any:
        """Read every part with ``read(ref, shard, rows, keys, objects[, copy])``; one batch in row order.

        ``copy=False`` is passed for pieces that are joined afterwards (see :func:`read_transport`).
        A part made of a few runs of consecutive rows is first offered whole to
        ``join(ref, runs, keys, objects)`` (see :func:`read_joined`), which may
        return it without copying the runs together.
        """
        out: Any = None
        for part in self._parts:
            got = _assemble_part(self, part, read, join)
            if out is None:
                out = got
            elif isinstance(out, DataProto):
                out = out.union(got)
            else:
                out.update(got)
        if isinstance(out, DataProto):
            out.auto_padding = self.auto_padding
        return out


def _rebuild(
    shards: tuple[ShardHandle, ...],
    parts: tuple[_Part, ...],
    length: int,
    meta_info: dict[str, Any],
    row_meta: dict[str, np.ndarray],
    auto_padding: bool,
) -> BatchRef:
    return BatchRef(shards, parts, length, meta_info, row_meta, auto_padding)


def _key_list(keys: Any) -> list[Any]:
    return [keys] if isinstance(keys, str) else list(keys)


def _regroup(per_key: dict[tuple[str, Any], np.ndarray]) -> list[_Part]:
    """Keys with identical row columns share one part."""
    groups: dict[bytes, tuple[list[Key], list[str], np.ndarray]] = {}
    for (kind, name), index in per_key.items():
        key = index.tobytes()
        entry = groups.setdefault(key, ([], [], index))
        (entry[1] if kind == "o" else entry[0]).append(name)
    return [_Part(tuple(t), tuple(o), idx) for t, o, idx in groups.values()]


def _read_here(
    ref: BatchRef,
    shard: int,
    rows: np.ndarray,
    keys: Sequence[Key],
    objects: Sequence[str],
    copy: bool = True,
) -> Any:
    handle = ref._shards[shard]
    if handle.released:
        raise ValueError(f"BatchRef {ref.ref_id} names rows that were released (release())")
    try:
        return read_transport(handle.info, rows, keys, objects, ref.meta_info, copy)
    except DataLostError as exc:
        raise DataLostError(ref.ref_id, handle.rank, detail=lost_detail(exc)) from None


# A part of more runs of consecutive rows than this is not offered to a joined read.
_MAX_JOINED_RUNS = 64


def _assemble_part(
    ref: BatchRef,
    part: _Part,
    read: Callable[..., Any],
    join: Callable[..., Any] | None = None,
) -> Any:
    index = part.index
    n = len(index)
    if n == 0:
        return read(ref, 0, np.zeros(0, dtype=np.int64), part.keys, part.objects)
    shards = index[:, 0]
    if shards[0] == shards[-1] and (n < 3 or bool((shards == shards[0]).all())):
        return read(ref, int(shards[0]), index[:, 1], part.keys, part.objects)  # one shard
    if join is not None:
        # Runs of consecutive rows of one shard, split where the shard changes or a row is skipped.
        breaks = np.flatnonzero((np.diff(shards) != 0) | (np.diff(index[:, 1]) != 1)) + 1
        if len(breaks) < _MAX_JOINED_RUNS:
            cuts = [0, *breaks.tolist(), n]
            runs = [(int(shards[a]), index[a:b, 1]) for a, b in zip(cuts, cuts[1:])]
            joined = join(ref, runs, part.keys, part.objects)
            if joined is not None:
                return joined
    # Runs of consecutive rows from one shard; the common case is one run per shard.
    bounds = np.flatnonzero(np.diff(shards)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [n]])
    # Several pieces are joined into new memory: each is read without a copy of its own.
    if len(starts) <= len(np.unique(shards)) or len(starts) <= 4:
        if len(starts) == 1:
            return read(ref, int(shards[0]), index[:, 1], part.keys, part.objects)
        pieces = [
            read(ref, int(shards[a]), index[a:b, 1], part.keys, part.objects, False)
            for a, b in zip(starts, ends)
        ]
        return _concat(pieces)
    # Scattered rows: one read per shard, then the rows put back in order.
    order = np.argsort(shards, kind="stable")
    pieces = []
    for s in np.unique(shards):
        rows = index[order[shards[order] == s], 1]
        pieces.append(read(ref, int(s), rows, part.keys, part.objects, False))
    joined = _concat(pieces)
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.arange(n)
    return joined[torch.from_numpy(inverse)] if isinstance(joined, TensorDict) else joined[inverse]


def _concat(pieces: list[Any]) -> Any:
    if isinstance(pieces[0], DataProto):
        return DataProto.concat(pieces)
    return torch.cat(pieces, dim=0)


# Dispatch splits and joins BatchRefs like any batch: index entries only, no data moves.
register_batch_type(
    BatchRef,
    length=len,
    chunk=lambda ref, n: list(ref.chunk(n)),
    concat=BatchRef.concat,
    pad=lambda ref, divisor: ref.pad_to_divisor(divisor)[0],
    unpad=lambda ref, rows: ref.unpad(rows),
)
