"""``DataProto``: the batch that dispatch splits over DP ranks and collect joins back.

A :class:`DataProto` holds three things that travel together:

- ``batch``: a :class:`tensordict.TensorDict` whose first batch dimension is the
  sample dimension (N). Tensors may be nested (``batch["a", "b"]``).
- ``non_tensor_batch``: ``dict[str, np.ndarray]``, each array with first dim N
  (usually ``dtype=object``: strings, dicts, ragged lists).
- ``meta_info``: a plain dict that describes the whole batch (temperatures,
  step counters, metrics); it is not split, every chunk gets a copy.

Contract shared by every operation here:

1. No operation mutates its input, except those documented as in place (as in
   verl): :meth:`DataProto.reorder`, :meth:`DataProto.pop`, :meth:`DataProto.padding`,
   and :meth:`DataProto.to`, :meth:`DataProto.rename`, :meth:`DataProto.union`, which
   change ``self`` and return it. Dispatch never calls them on the caller's object.
2. Every returned ``DataProto`` owns its ``TensorDict`` object and its
   ``non_tensor_batch`` / ``meta_info`` dicts (shallow copies), so setting a key
   or a meta value on one chunk never shows up in another chunk or in the
   source (verl shared one ``meta_info`` dict between all chunks). Tensor and
   array *memory* is shared where numpy/torch indexing shares it (slices,
   chunks, splits are views); use :meth:`DataProto.copy` for independent memory.
3. Bad input raises :class:`podium.errors.DataProtoError` (a ``ValueError`` and,
   for code ported from verl, an ``AssertionError``) / ``TypeError`` /
   ``KeyError`` / ``IndexError`` naming the key and the sizes involved; nothing
   is checked with ``assert``.

Pickling bypasses TensorDict's own pickling and ``torch.save``: a DataProto
pickles as a flat dict of plain tensors, so podium's serializer
(:mod:`podium.core.serialization`) sends each tensor as one out-of-band buffer.
"""

from __future__ import annotations

import copy as _copy
import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, overload

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from podium.core._batch_utils import (
    as_array,
    as_key_list,
    describe,
    is_metrics,
    leaves,
    merge_checked,
    missing,
    normalize_index,
    object_array,
    tensor_shapes,
    values_equal,
)
from podium.core.protocol_config import DataProtoConfig
from podium.errors import DataProtoError

__all__ = [
    "DataProto",
    "DataProtoItem",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
]

Index: TypeAlias = (
    "int | np.integer | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor"
)
Key: TypeAlias = "str | tuple[str, ...]"

# ---------------------------------------------------------------------------
# DataProto


@dataclass(eq=False)
class DataProtoItem:
    """One row of a :class:`DataProto` (``data[i]``).

    ``batch`` is a TensorDict with ``batch_size`` equal to the original batch
    size without its first dim; ``non_tensor_batch`` maps each key to the row's
    value; ``meta_info`` is a shallow copy of the source's.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """A batch of N samples: tensors, per-sample Python objects, and batch-wide metadata.

    Invariants (checked when built, see :meth:`check_consistency`):

    - ``batch`` is ``None`` or a TensorDict with at least one batch dim; its
      first dim is N. More batch dims are allowed (``from_dict(num_batch_dims=2)``);
      every operation here works on the first one.
    - every ``non_tensor_batch`` value is a numpy array whose first dim is N;
      lists and tuples are converted to 1-D object arrays.
    - ``len(data)`` is N; without a batch it is the non-tensor length; an empty
      DataProto has length 0.

    ``auto_padding=True`` asks the dispatcher to pad a batch that does not divide
    by the DP size (and to drop the pad rows from the result) instead of raising;
    ``DataProtoConfig.auto_padding = True`` (or ``PODIUM_AUTO_PADDING=1``) asks it
    for every DataProto (:meth:`is_padding_enabled`). The constructor copies the
    ``non_tensor_batch`` and ``meta_info`` dicts it is given, never the tensors
    or arrays; ``None`` for either means empty, as in verl.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)
    auto_padding: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        # verl spells "empty" as None too: DataProto(batch=None, non_tensor_batch=None).
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        if self.batch is not None and not isinstance(self.batch, TensorDictBase):
            raise TypeError(f"batch must be a TensorDict or None, got {type(self.batch).__name__}")
        if not isinstance(self.non_tensor_batch, Mapping):
            raise TypeError(
                f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}"
            )
        if not isinstance(self.meta_info, Mapping):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        self.non_tensor_batch = {k: as_array(k, v) for k, v in self.non_tensor_batch.items()}
        self.meta_info = dict(self.meta_info)
        self.check_consistency()

    def check_consistency(self) -> None:
        """Raise :class:`DataProtoError` unless every part agrees on the sample dimension N."""
        n: int | None = None
        source = ""
        if self.batch is not None:
            if len(self.batch.batch_size) != 1:
                raise DataProtoError(
                    "batch must have exactly one batch dimension (the sample dimension), "
                    f"got batch_size={list(self.batch.batch_size)}; as in verl, a DataProto "
                    "has one batch dim (use fold_batch_dim/unfold_batch_dim to group rows, "
                    "or pass a TensorDict with more batch dims)"
                )
            n, source = (
                int(self.batch.batch_size[0]),
                f"batch (batch_size={list(self.batch.batch_size)})",
            )
        for key, value in self.non_tensor_batch.items():
            if n is None:
                n, source = value.shape[0], f"non_tensor_batch[{key!r}]"
            elif value.shape[0] != n:
                raise DataProtoError(
                    f"non_tensor_batch[{key!r}] has {value.shape[0]} rows but {source} has {n}; "
                    "every entry needs the same first dimension"
                )

    # -- construction -------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, Any] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from ``{name: tensor}`` (nested dicts allowed), ``{name: array|list}`` and meta.

        The parameters and their order are verl's. The batch size is the first
        dim of the tensors, which must agree. No tensors: ``batch`` is ``None``.
        ``num_batch_dims`` must be 1: a DataProto has one batch dimension (verl
        refuses other values too); keep a ``TensorDict`` for more, or group rows
        with :func:`fold_batch_dim`.
        """
        if not isinstance(num_batch_dims, int) or isinstance(num_batch_dims, bool) or num_batch_dims < 1:
            raise DataProtoError(f"num_batch_dims must be an int >= 1, got {num_batch_dims!r}")
        if not isinstance(auto_padding, bool):
            raise TypeError(f"auto_padding must be a bool, got {type(auto_padding).__name__}")
        batch = None
        if tensors:
            shapes = tensor_shapes(tensors)
            first_key, first_shape = next(iter(shapes.items()))
            if len(first_shape) < num_batch_dims:
                raise DataProtoError(
                    f"tensor {first_key!r} has shape {list(first_shape)}, fewer dims than "
                    f"num_batch_dims={num_batch_dims}"
                )
            batch_size = first_shape[:num_batch_dims]
            for key, shape in shapes.items():
                if shape[:num_batch_dims] != batch_size:
                    raise DataProtoError(
                        f"tensor {key!r} has shape {list(shape)} but tensor {first_key!r} has "
                        f"{list(first_shape)}; the first {num_batch_dims} dim(s) must agree"
                    )
            if num_batch_dims != 1:
                raise DataProtoError(
                    f"num_batch_dims={num_batch_dims}: a DataProto has exactly one batch dimension "
                    "(verl asserts the same); use a TensorDict for several batch dims, or "
                    "fold_batch_dim(data, new_batch_size) to group rows"
                )
            batch = TensorDict(dict(tensors), batch_size=list(batch_size))
        elif num_batch_dims != 1:
            raise DataProtoError(
                f"num_batch_dims={num_batch_dims}: a DataProto has exactly one batch dimension"
            )
        return cls(
            batch=batch,
            non_tensor_batch=dict(non_tensors or {}),
            meta_info=dict(meta_info or {}),
            auto_padding=auto_padding,
        )

    @classmethod
    def from_single_dict(
        cls,
        data: Mapping[str, Any],
        meta_info: Mapping[str, Any] | None = None,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from one dict: tensors go to ``batch``, arrays and lists to ``non_tensor_batch``."""
        tensors: dict[str, Any] = {}
        non_tensors: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise TypeError(
                    f"data[{key!r}] must be a tensor, a numpy array or a list, "
                    f"got {type(value).__name__}"
                )
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls,
        tensor_dict: TensorDictBase,
        meta_info: Mapping[str, Any] | None = None,
        num_batch_dims: int = 1,
        *,
        auto_padding: bool = False,
    ) -> DataProto:
        """Inverse of :meth:`to_tensordict`; ``tensor_dict`` is not modified.

        Top-level ``NonTensorStack`` entries become ``non_tensor_batch`` object
        arrays; top-level ``NonTensorData`` entries (one value for the whole
        batch) become ``meta_info``; everything else, tensors and nested
        TensorDicts, stays in ``batch``. Explicit ``meta_info`` wins over
        entries of the same name in ``tensor_dict``. The parameter names are
        verl's; ``num_batch_dims`` must be 1 (the batch keeps only the first
        batch dim of ``tensor_dict``), as in verl.
        """
        td = tensor_dict
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"from_tensordict needs a TensorDict, got {type(td).__name__}")
        if num_batch_dims != 1:
            raise DataProtoError(
                f"num_batch_dims={num_batch_dims}: a DataProto has exactly one batch dimension "
                "(verl asserts the same); keep the TensorDict for several batch dims"
            )
        if td.batch_dims == 0:
            raise DataProtoError(
                "from_tensordict needs a TensorDict with a batch dimension, got batch_size=[]"
            )
        non_tensors: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {}
        for key in list(td.keys()):
            value = td.get(key)
            if isinstance(value, NonTensorStack):
                non_tensors[key] = object_array(value.tolist())
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
        batch = td.exclude(*non_tensors, *meta) if (non_tensors or meta) else td.copy()
        if batch.batch_dims > 1:
            batch.batch_size = batch.batch_size[:1]
        meta.update(meta_info or {})
        return cls(
            batch=batch, non_tensor_batch=non_tensors, meta_info=meta, auto_padding=auto_padding
        )

    def to_tensordict(self) -> TensorDict:
        """One TensorDict holding everything (a new object; tensors are shared).

        ``non_tensor_batch`` entries are stored as ``NonTensorStack`` (one value
        per row, so indexing and ``torch.cat`` keep them aligned) and
        ``meta_info`` entries as ``NonTensorData`` (one value for all rows).
        :meth:`from_tensordict` reads them back; non-tensor arrays come back as
        object arrays. ``auto_padding`` is not stored.
        """
        td = self.batch.copy() if self.batch is not None else TensorDict({}, batch_size=[len(self)])
        clash = (set(self.non_tensor_batch) | set(self.meta_info)) & set(td.keys())
        clash |= set(self.non_tensor_batch) & set(self.meta_info)
        if clash:
            raise DataProtoError(
                f"key(s) {sorted(map(str, clash))} appear in more than one of batch, "
                "non_tensor_batch and meta_info; a TensorDict holds each name once"
            )
        for key, arr in self.non_tensor_batch.items():
            td.set(key, NonTensorStack.from_list(list(arr)))
        for key, value in self.meta_info.items():
            td.set_non_tensor(key, value)
        return td

    # -- size, indexing -----------------------------------------------------

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return int(value.shape[0])
        return 0

    def _new(self, batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray]) -> DataProto:
        return type(self)(
            batch=batch,
            non_tensor_batch=non_tensor_batch,
            meta_info=dict(self.meta_info),
            auto_padding=self.auto_padding,
        )

    def _take(self, index: slice | np.ndarray) -> DataProto:
        """Rows at ``index`` (a normalized slice or int64 array) as a new DataProto."""
        batch = None
        if self.batch is not None:
            batch = self.batch[index if isinstance(index, slice) else torch.from_numpy(index)]
        return self._new(batch, {k: v[index] for k, v in self.non_tensor_batch.items()})

    @overload
    def __getitem__(self, index: int | np.integer) -> DataProtoItem: ...

    @overload
    def __getitem__(
        self, index: slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor
    ) -> DataProto: ...

    def __getitem__(self, index: Index) -> DataProtoItem | DataProto:
        """``data[i]`` is a :class:`DataProtoItem` (one row, as in verl); a slice, a
        list/array/LongTensor of indices or a boolean mask gives a DataProto.

        Slices are views of the same memory; index arrays and masks copy.
        """
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            n = len(self)
            if not -n <= int(index) < n:
                raise IndexError(
                    f"index {int(index)} is out of range for a DataProto of length {n}"
                )
            return self._item(int(index) % n)
        if isinstance(index, torch.Tensor) and index.ndim == 0:
            return self[int(index.item())]
        return self._take(normalize_index(index, len(self)))

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self._item(i)

    def _item(self, i: int) -> DataProtoItem:
        return DataProtoItem(
            batch=self.batch[i] if self.batch is not None else None,
            non_tensor_batch={k: v[i] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def slice(
        self, start: int | None = None, end: int | None = None, step: int | None = None
    ) -> DataProto:
        """Rows ``start:end:step`` (a view, like ``data[start:end:step]``)."""
        return self._take(normalize_index(slice(start, end, step), len(self)))

    # -- keys ----------------------------------------------------------------

    def select(
        self,
        batch_keys: Sequence[Key] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the named keys (``None`` keeps all keys of that part).

        Shares tensors and arrays unless ``deepcopy=True``. As in verl, a batch
        key that is not there raises ``KeyError``, while ``non_tensor_batch`` and
        ``meta_info`` keys that are not there are skipped (select what exists).
        """
        batch = self.batch
        if batch is not None:
            if batch_keys is None:
                batch = batch.copy()
            else:
                keys = list(batch_keys) if not isinstance(batch_keys, str) else [batch_keys]
                missing(keys, batch.keys(include_nested=True), "batch")
                batch = batch.select(*keys)
        elif batch_keys:
            raise KeyError(f"batch has no key(s) {list(batch_keys)}: this DataProto has no batch")
        nt_keys = list(self.non_tensor_batch)
        if non_tensor_batch_keys is not None:
            wanted = set(as_key_list(non_tensor_batch_keys, "non_tensor_batch_keys"))
            nt_keys = [k for k in nt_keys if k in wanted]
        meta_keys = list(self.meta_info)
        if meta_info_keys is not None:
            wanted = set(as_key_list(meta_info_keys, "meta_info_keys"))
            meta_keys = [k for k in meta_keys if k in wanted]
        out = type(self)(
            batch=batch,
            non_tensor_batch={k: self.non_tensor_batch[k] for k in nt_keys},
            meta_info={k: self.meta_info[k] for k in meta_keys},
            auto_padding=self.auto_padding,
        )
        return _copy.deepcopy(out) if deepcopy else out

    def pop(
        self,
        batch_keys: Sequence[Key] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """In place: remove the named keys from ``self`` and return them as a new DataProto.

        ``None`` pops nothing from that part. The returned batch keeps
        ``self``'s batch size even when it holds no keys. All keys are checked
        before anything is removed.
        """
        b_keys = [batch_keys] if isinstance(batch_keys, str) else list(batch_keys or [])
        nt_keys = as_key_list(non_tensor_batch_keys, "non_tensor_batch_keys")
        meta_keys = as_key_list(meta_info_keys, "meta_info_keys")
        if b_keys and self.batch is None:
            raise KeyError(f"batch has no key(s) {b_keys}: this DataProto has no batch")
        if self.batch is not None:
            missing(b_keys, self.batch.keys(include_nested=True), "batch")
        missing(nt_keys, self.non_tensor_batch, "non_tensor_batch")
        missing(meta_keys, self.meta_info, "meta_info")
        batch = None
        if self.batch is not None:
            batch = self.batch.select(*b_keys)
            self.batch = self.batch.exclude(*b_keys)
        return type(self)(
            batch=batch,
            non_tensor_batch={k: self.non_tensor_batch.pop(k) for k in nt_keys},
            meta_info={k: self.meta_info.pop(k) for k in meta_keys},
            auto_padding=self.auto_padding,
        )

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """In place, as in verl: rename keys (in ``batch`` or ``non_tensor_batch``, where
        found) and return ``self``. All names are checked before anything changes."""
        old = as_key_list(old_keys, "old_keys")
        new = as_key_list(new_keys, "new_keys")
        if len(old) != len(new):
            raise DataProtoError(
                f"rename needs as many new keys as old keys, got {len(old)} old and {len(new)} new"
            )
        batch_keys = set(self.batch.keys()) if self.batch is not None else set()
        taken = set(self.non_tensor_batch) | batch_keys
        plan: list[tuple[str, str, bool]] = []
        for o, n in zip(old, new):
            if o == n:
                continue
            if n in taken:
                raise DataProtoError(f"cannot rename {o!r} to {n!r}: {n!r} already exists")
            if o in batch_keys:
                plan.append((o, n, True))
                batch_keys.discard(o)
                batch_keys.add(n)
            elif o in self.non_tensor_batch and all(p[0] != o for p in plan):
                plan.append((o, n, False))
            else:
                raise KeyError(f"cannot rename {o!r}: no such key in batch or non_tensor_batch")
            taken.discard(o)
            taken.add(n)
        for o, n, in_batch in plan:
            if in_batch and self.batch is not None:
                self.batch.rename_key_(o, n)
            else:
                self.non_tensor_batch[n] = self.non_tensor_batch.pop(o)
        return self

    def union(self, other: DataProto) -> DataProto:
        """In place, as in verl: add the keys of ``other`` to ``self`` and return ``self``.

        A key present in both must hold equal values, else :class:`DataProtoError`;
        lengths must match. Everything is checked before ``self`` changes.
        ``self.auto_padding`` stays as it is.
        """
        if not isinstance(other, DataProto):
            raise TypeError(f"union needs a DataProto, got {type(other).__name__}")
        if (self.batch is not None or self.non_tensor_batch) and (
            other.batch is not None or other.non_tensor_batch
        ):
            if len(self) != len(other):
                raise DataProtoError(f"cannot union DataProtos of length {len(self)} and {len(other)}")
        new_leaves: dict[Key, Any] = {}
        if other.batch is not None and self.batch is not None:
            if self.batch.batch_size != other.batch.batch_size:
                raise DataProtoError(
                    f"cannot union batches of batch_size {list(self.batch.batch_size)} and "
                    f"{list(other.batch.batch_size)}"
                )
            mine = leaves(self.batch)
            for key, value in leaves(other.batch).items():
                if key in mine:
                    if not values_equal(mine[key], value):
                        raise DataProtoError(
                            f"union: batch key {key!r} differs between the two DataProtos"
                        )
                else:
                    new_leaves[key] = value
        non_tensors = dict(self.non_tensor_batch)
        merge_checked(non_tensors, other.non_tensor_batch, "non_tensor_batch")
        meta = dict(self.meta_info)
        merge_checked(meta, other.meta_info, "meta_info")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch.copy()
            else:
                for key, value in new_leaves.items():
                    self.batch.set(key, value)
        self.non_tensor_batch.update(non_tensors)
        self.meta_info.update(meta)
        return self

    # -- reshaping -----------------------------------------------------------

    def reorder(self, indices: Index) -> None:
        """In place: ``self`` becomes ``self[indices]`` (any 1-D index, usually a permutation)."""
        taken = self._take(normalize_index(indices, len(self)))
        self.batch = taken.batch
        self.non_tensor_batch = taken.non_tensor_batch

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts (views); ``len(self)`` must divide by ``chunks``."""
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise DataProtoError(f"chunks must be a positive int, got {chunks!r}")
        n = len(self)
        if n % chunks:
            if self.is_padding_enabled():
                raise DataProtoError(
                    f"a DataProto of length {n} cannot be split into {chunks} equal chunks. "
                    "Padding is enabled for it, but chunk() does not pad: verl's chunk() then "
                    "returns chunks of unequal size; in podium dispatch pads (and removes the pad "
                    "rows from the result), and code that chunks by hand pads first with "
                    "pad_dataproto_to_divisor(data, chunks) or data.padding(pad_size)"
                )
            raise DataProtoError(
                f"a DataProto of length {n} cannot be split into {chunks} equal chunks; "
                "pad it first (pad_dataproto_to_divisor) or set auto_padding=True for dispatch"
            )
        size = n // chunks
        return [self._take(slice(i * size, (i + 1) * size)) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into parts of ``split_size`` rows (views); the last may be shorter."""
        if not isinstance(split_size, int) or isinstance(split_size, bool) or split_size < 1:
            raise DataProtoError(f"split_size must be a positive int, got {split_size!r}")
        return [self._take(slice(i, i + split_size)) for i in range(0, len(self), split_size)]

    @classmethod
    def concat(cls, data: Sequence[DataProto]) -> DataProto:
        """Join DataProtos along the sample dim (copies the data).

        All parts must have the same batch keys and non-tensor keys.
        ``meta_info`` is the union of the parts' meta_info. A key present in
        several parts must hold equal values, else :class:`DataProtoError` (as in
        verl) -- except ``"metrics"`` (a dict, or list of dicts, per part; ``None``
        is skipped), which is merged into one dict of lists: per-rank values
        belong under ``meta_info["metrics"]``. ``auto_padding`` comes from the
        first part.
        """
        parts = list(data)
        if not parts:
            raise DataProtoError("concat needs at least one DataProto, got an empty list")
        for i, part in enumerate(parts):
            if not isinstance(part, DataProto):
                raise TypeError(f"concat: item {i} is a {type(part).__name__}, not a DataProto")
        meta: dict[str, Any] = {}
        metrics: list[Any] = []
        for part in parts:
            for key, value in part.meta_info.items():
                if key == "metrics" and (value is None or is_metrics(value)):
                    if value is not None:
                        metrics.extend(value if isinstance(value, list) else [value])
                elif key not in meta:
                    meta[key] = value
                elif not values_equal(meta[key], value):
                    raise DataProtoError(
                        f"Conflicting values for meta_info key {key!r} in concat: {meta[key]!r} "
                        f"and {value!r}. Values that differ per part (per rank) belong under "
                        'meta_info["metrics"], which concat merges'
                    )
        if metrics:
            merged: dict[str, list[Any]] = {}
            for entry in metrics:
                for k, v in entry.items():
                    merged.setdefault(k, []).append(v)
            meta["metrics"] = merged
        return cls._concat_rows(parts, meta, parts[0].auto_padding)

    @classmethod
    def _concat_rows(
        cls, parts: list[DataProto], meta_info: dict[str, Any], auto_padding: bool
    ) -> DataProto:
        first = parts[0]
        batches = [p.batch for p in parts if p.batch is not None]
        if batches and len(batches) != len(parts):
            raise DataProtoError("concat: some DataProtos have a batch and some do not")
        batch = None
        if batches:
            keys = set(leaves(batches[0]))
            for i, part_batch in enumerate(batches[1:], 1):
                other = set(leaves(part_batch))
                if other != keys:
                    raise DataProtoError(
                        f"concat: batch keys of item {i} {sorted(map(str, other))} differ from "
                        f"item 0 {sorted(map(str, keys))}"
                    )
            batch = cat_batches(batches)
        nt_keys = set(first.non_tensor_batch)
        for i, part in enumerate(parts[1:], 1):
            if set(part.non_tensor_batch) != nt_keys:
                raise DataProtoError(
                    f"concat: non_tensor_batch keys of item {i} {sorted(part.non_tensor_batch)} "
                    f"differ from item 0 {sorted(nt_keys)}"
                )
        non_tensors = {
            k: np.concatenate([p.non_tensor_batch[k] for p in parts], axis=0)
            for k in first.non_tensor_batch
        }
        return cls(
            batch=batch,
            non_tensor_batch=non_tensors,
            meta_info=meta_info,
            auto_padding=auto_padding,
        )

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` with ``interleave``, else ``abab``."""
        if not isinstance(repeat_times, int) or isinstance(repeat_times, bool) or repeat_times < 1:
            raise DataProtoError(f"repeat_times must be a positive int, got {repeat_times!r}")
        rows = np.arange(len(self))
        index = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self._take(index)

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times, in row order (``aaabcc`` for ``[3, 1, 2]``)."""
        if isinstance(repeat_times, torch.Tensor):
            times = repeat_times.detach().cpu().numpy()
        else:
            times = np.asarray(repeat_times)
        if times.ndim != 1 or times.shape[0] != len(self):
            raise DataProtoError(
                f"repeat_times needs one count per row ({len(self)}), got shape {list(times.shape)}"
            )
        if times.size and (not np.issubdtype(times.dtype, np.integer) or times.min() < 0):
            raise DataProtoError("repeat_times must hold ints >= 0")
        return self._take(np.repeat(np.arange(len(self)), times.astype(np.int64)))

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut each row of the ``split_keys`` into ``n_split`` pieces along dim 1 and make each
        piece a row; the other keys repeat each row ``n_split`` times (verl's semantics).

        A 1-D object array whose rows are equal-length sequences is split as if it
        were 2-D (the result is a 2-D object array, as verl gives).
        """
        if not isinstance(n_split, int) or isinstance(n_split, bool) or n_split < 1:
            raise DataProtoError(f"n_split must be a positive int, got {n_split!r}")
        keys = set(as_key_list(split_keys, "split_keys"))
        n = len(self)

        def cut(key: str, value: Any) -> Any:
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(
                    f"unfold_column_chunks: {key!r} has shape {list(value.shape)}; its dim 1 must "
                    f"divide by n_split={n_split}"
                )
            return value.reshape(n * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            batch = TensorDict({}, batch_size=[n * n_split], device=self.batch.device)
            for key, value in leaves(self.batch).items():
                if key in keys:
                    batch.set(key, cut(str(key), value))
                else:
                    batch.set(key, torch.repeat_interleave(value, n_split, dim=0))
        non_tensors: dict[str, np.ndarray] = {}
        for key, arr in self.non_tensor_batch.items():
            if key not in keys:
                non_tensors[key] = np.repeat(arr, n_split, axis=0)
                continue
            if arr.ndim == 1 and arr.dtype == object and n:
                widths = {len(row) if isinstance(row, (list, tuple, np.ndarray)) else -1 for row in arr}
                if len(widths) != 1 or -1 in widths:
                    raise DataProtoError(
                        f"unfold_column_chunks: the rows of non_tensor_batch[{key!r}] must be "
                        "sequences of one length"
                    )
                grid = np.empty((n, widths.pop()), dtype=object)
                for i, row in enumerate(arr):
                    grid[i, :] = list(row)
                arr = grid
            non_tensors[key] = cut(key, arr)
        return self._new(batch, non_tensors)

    def is_padding_enabled(self) -> bool:
        """Whether dispatch may pad this batch: its ``auto_padding`` flag, verl's
        ``meta_info["_verl_auto_padding"]``, or the global :class:`DataProtoConfig` switch."""
        return bool(
            self.auto_padding
            or self.meta_info.get(DataProtoConfig.auto_padding_key, False)
            or DataProtoConfig.auto_padding
        )

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """In place, as in verl: append ``padding_size`` copies of the last row (of the first
        row with ``padding_candidate="first"``). Dispatch never calls this on your data; it
        pads a new object (:func:`pad_dataproto_to_divisor`)."""
        if not isinstance(padding_size, int) or isinstance(padding_size, bool) or padding_size < 0:
            raise DataProtoError(f"padding_size must be an int >= 0, got {padding_size!r}")
        if padding_size == 0:
            return
        n = len(self)
        if n == 0:
            raise DataProtoError("cannot pad an empty DataProto: there is no row to repeat")
        row = 0 if padding_candidate == "first" else n - 1
        padded = self._take(np.concatenate([np.arange(n), np.full(padding_size, row)]))
        self.batch = padded.batch
        self.non_tensor_batch = padded.non_tensor_batch

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` rows, ``epochs`` times over (verl's semantics).

        Rows are drawn by a ``torch.utils.data.DataLoader`` built with
        ``dataloader_kwargs`` (``{"shuffle": True}`` shuffles; ``seed`` seeds its
        generator so two iterators with one seed agree). ``len(self)`` must divide
        by ``mini_batch_size``. Each mini-batch gets its own copy of ``meta_info``.
        """
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise DataProtoError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
        if len(self) % mini_batch_size:
            raise DataProtoError(
                f"make_iterator: the DataProto has {len(self)} rows, which does not divide by "
                f"mini_batch_size={mini_batch_size}"
            )
        kwargs = dict(dataloader_kwargs or {})
        if not isinstance(dataloader_kwargs, (dict, type(None))):
            raise TypeError(f"dataloader_kwargs must be a dict, got {type(dataloader_kwargs).__name__}")
        from torch.utils.data import DataLoader

        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        loader: DataLoader[DataProto] = DataLoader(
            range(len(self)),  # type: ignore[arg-type]
            batch_size=mini_batch_size,
            collate_fn=_RowPicker(self),
            generator=generator,
            **kwargs,
        )

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                yield from loader

        return batches()

    def select_idxs(self, idxs: Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor) -> DataProto:
        """The rows at ``idxs`` (ints or a boolean mask; list, array or tensor) as a new DataProto."""
        return self._take(normalize_index(idxs, len(self)))

    def save_to_disk(self, filepath: str | os.PathLike[str]) -> None:
        """Pickle to ``filepath`` (read back with :meth:`load_from_disk`)."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @classmethod
    def load_from_disk(cls, filepath: str | os.PathLike[str]) -> DataProto:
        """Read a DataProto written by :meth:`save_to_disk`.

        This unpickles the file: load only files you trust.
        """
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{os.fspath(filepath)!r} holds a {type(data).__name__}, not a DataProto")
        return data

    def get_data_info(self) -> str:
        """A multi-line summary: each batch key's shape, dtype and device, each non-tensor
        array's shape and dtype, and each ``meta_info`` value's type (nested types spelled out)."""
        info = ["batch"]
        if self.batch is not None:
            for key, value in leaves(self.batch).items():
                name = ".".join(key) if isinstance(key, tuple) else key
                if isinstance(value, torch.Tensor):
                    info.append(f"  {name}: {tuple(value.shape)} ({value.dtype}) {value.device}")
                else:
                    info.append(f"  {name}: {type(value).__name__}")
        info.append("non_tensor_batch")
        for key, arr in self.non_tensor_batch.items():
            info.append(f"  {key}: ndarray{arr.shape} ({arr.dtype})")
        info.append("meta_info")
        for key, value in self.meta_info.items():
            info.append(f"  {key}: {type_info(value)}")
        return "\n".join(info)

    def print_size(self, prefix: str = "") -> None:
        """Print the memory the tensors and the non-tensor arrays take, in GB."""
        tensor_bytes = 0
        if self.batch is not None:
            for value in leaves(self.batch).values():
                if isinstance(value, torch.Tensor):
                    tensor_bytes += value.element_size() * value.numel()
        array_bytes = sum(arr.nbytes for arr in self.non_tensor_batch.values())
        message = (
            f"Size of tensordict: {tensor_bytes / 1024**3} GB, "
            f"size of non_tensor_batch: {array_bytes / 1024**3} GB"
        )
        print(f"{prefix}, {message}" if prefix else message)

    # -- devices, copies, pickling --------------------------------------------

    def to(self, device: str | torch.device) -> DataProto:
        """In place, as in verl: move the batch to ``device`` and return ``self``
        (non-tensors stay where they are). ``copy.copy(data).to(device)`` leaves ``data`` as it is."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def copy(self) -> DataProto:
        """An independent deep copy (tensors, arrays and meta_info values copied)."""
        return _copy.deepcopy(self)

    def __copy__(self) -> DataProto:
        batch = self.batch.copy() if self.batch is not None else None
        return self._new(batch, dict(self.non_tensor_batch))

    def __deepcopy__(self, memo: dict[int, Any]) -> DataProto:
        return type(self)(
            batch=_copy.deepcopy(self.batch, memo),
            non_tensor_batch=_copy.deepcopy(self.non_tensor_batch, memo),
            meta_info=_copy.deepcopy(self.meta_info, memo),
            auto_padding=self.auto_padding,
        )

    def __getstate__(self) -> dict[str, Any]:
        """A flat, TensorDict-free state: plain tensors keyed by str / tuple path."""
        tensors = None
        batch_size = None
        device = None
        if self.batch is not None:
            tensors = leaves(self.batch)
            batch_size = list(self.batch.batch_size)
            device = str(self.batch.device) if self.batch.device is not None else None
        return {
            "tensors": tensors,
            "batch_size": batch_size,
            "device": device,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
            "auto_padding": self.auto_padding,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        batch = None
        if state["tensors"] is not None:
            tensors: dict[Key, Any] = state["tensors"]
            device = state["device"]
            # The serializer moves tensors to CPU; keep the recorded device only
            # where the tensors still are on it.
            if device is not None and any(
                isinstance(t, torch.Tensor) and t.device != torch.device(device)
                for t in tensors.values()
            ):
                device = None
            batch = TensorDict({}, batch_size=state["batch_size"], device=device)
            for key, value in tensors.items():
                batch.set(key, value)
        self.batch = batch
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
        self.auto_padding = state["auto_padding"]
        self.check_consistency()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.__getstate__()))

    def __repr__(self) -> str:
        parts = [f"len={len(self)}"]
        if self.batch is not None:
            fields = ", ".join(f"{k}: {describe(v)}" for k, v in leaves(self.batch).items())
            parts.append(f"batch={{{fields}}}")
        if self.non_tensor_batch:
            fields = ", ".join(
                f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.non_tensor_batch.items()
            )
            parts.append(f"non_tensor_batch={{{fields}}}")
        if self.meta_info:
            parts.append(f"meta_info_keys={list(self.meta_info)}")
        if self.auto_padding:
            parts.append("auto_padding=True")
        return f"{type(self).__name__}({', '.join(parts)})"


class _RowPicker:
    """``collate_fn`` of :meth:`DataProto.make_iterator`: a list of row numbers -> those rows."""

    def __init__(self, data: DataProto) -> None:
        self.data = data

    def __call__(self, rows: list[int]) -> DataProto:
        return self.data._take(np.asarray(rows, dtype=np.int64))


def type_info(value: Any) -> str:
    """The type of ``value``, with the element types of lists, tuples, dicts and arrays."""
    if isinstance(value, list):
        elems = sorted({type_info(v) for v in value[:3]})
        return f"list[{'|'.join(elems) if elems else '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(type_info(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        k, v = next(iter(value.items()))
        return f"dict[{type_info(k)}: {type_info(v)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__


def _rebuild(cls: type[DataProto], state: dict[str, Any]) -> DataProto:
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


_LARGE = 1 << 20  # bytes; above this rows are joined by numpy


_row_joiners: list[Callable[[list[torch.Tensor]], torch.Tensor | None]] = []


def register_row_joiner(join: Callable[[list[torch.Tensor]], torch.Tensor | None]) -> None:
    """Let a backend join large row blocks without a copy: ``join(parts)`` returns the joined
    tensor, or None to leave it to :func:`cat_rows` (a backend whose results lie in memory
    it can map side by side registers one; see the torchrun backend)."""
    if join not in _row_joiners:
        _row_joiners.append(join)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts, dim=0)``, fast for large CPU tensors.

    Large CPU tensors are joined by ``np.concatenate`` over their bytes: numpy
    allocates the output on transparent huge pages and copies on one thread,
    which measured 5-7x faster here than ``torch.cat`` (page faults on a fresh
    torch allocation, and thread contention on a busy host) -- the dominant
    cost of collecting a large DP result.
    """
    first = parts[0]
    rows = sum(int(p.shape[0]) for p in parts)
    nbytes = first.element_size() * first[:1].numel() * rows
    if first.device.type != "cpu" or nbytes < _LARGE or first.dim() == 0:
        return torch.cat(parts, dim=0)
    for join in _row_joiners:
        joined = join(parts)
        if joined is not None:
            return joined
    as_bytes = [p.contiguous().view(torch.uint8).reshape(int(p.shape[0]), -1).numpy() for p in parts]
    joined = torch.from_numpy(np.concatenate(as_bytes, axis=0))
    return joined.view(first.dtype).reshape(rows, *first.shape[1:])


def cat_batches(batches: list[TensorDict]) -> TensorDict:
    per_key = [leaves(b) for b in batches]
    if not all(isinstance(v, torch.Tensor) and type(v) is torch.Tensor for v in per_key[0].values()):
        return TensorDict.cat(batches, dim=0)  # non-tensor leaves: tensordict knows them
    rows = sum(int(b.batch_size[0]) for b in batches)
    out = TensorDict({}, batch_size=[rows, *batches[0].batch_size[1:]])
    for key in per_key[0]:
        parts = [leaf[key] for leaf in per_key]
        out.set(key, cat_rows(parts))
    return out


# ---------------------------------------------------------------------------
# padding


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """``(padded, pad_size)`` with ``len(padded)`` the next multiple of ``size_divisor``.

    Always a new DataProto; ``data`` is not touched. Pad rows are copies of the
    first rows, repeated cyclically when ``pad_size > len(data)``.
    """
    if not isinstance(size_divisor, int) or isinstance(size_divisor, bool) or size_divisor < 1:
        raise DataProtoError(f"size_divisor must be a positive int, got {size_divisor!r}")
    n = len(data)
    pad_size = -n % size_divisor
    if pad_size == 0:
        return _copy.copy(data), 0
    padding = data._take(np.arange(pad_size) % n)
    padded = type(data)._concat_rows([data, padding], dict(data.meta_info), data.auto_padding)
    return padded, pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (a view); ``pad_size == 0`` returns ``data`` itself."""
    if not isinstance(pad_size, int) or isinstance(pad_size, bool) or pad_size < 0:
        raise DataProtoError(f"pad_size must be an int >= 0, got {pad_size!r}")
    if pad_size == 0:
        return data
    if pad_size > len(data):
        raise DataProtoError(
            f"cannot remove {pad_size} pad rows from a DataProto of length {len(data)}"
        )
    return data.slice(0, len(data) - pad_size)
