"""Module-level DataProto functions with verl's names and semantics.

``union_tensor_dict`` / ``union_numpy_dict`` merge dicts in place, refusing
shared keys whose values differ; ``fold_batch_dim`` / ``unfold_batch_dim``
group rows into a second dim and back; the ``serialize_*`` / ``deserialize_*``
pairs turn tensors and TensorDicts into (dtype, shape, bytes) records and back;
``collate_fn`` stacks :class:`DataProtoItem` rows; ``all_gather_data_proto``
gathers a DataProto over a ``torch.distributed`` process group. Errors are
:class:`podium.errors.DataProtoError` (a ``ValueError`` and, as verl code
expects, an ``AssertionError``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from podium.core._batch_utils import leaves, object_array
from podium.core.protocol import DataProto, DataProtoItem
from podium.errors import DataProtoError

__all__ = [
    "all_gather_data_proto",
    "collate_fn",
    "deep_equal",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
]

SerializedTensor = tuple[str, tuple[int, ...], np.ndarray]


# -- unions ----------------------------------------------------------------------


def union_tensor_dict(tensor_dict1: TensorDictBase, tensor_dict2: TensorDictBase) -> TensorDictBase:
    """Add the keys of ``tensor_dict2`` to ``tensor_dict1`` (in place) and return it.

    Batch sizes must match and a key in both must hold equal tensors; both are
    checked before ``tensor_dict1`` changes.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            "Two tensor dict must have identical batch size. Got "
            f"{list(tensor_dict1.batch_size)} and {list(tensor_dict2.batch_size)}"
        )
    mine = leaves(tensor_dict1)
    new = {}
    for key, value in leaves(tensor_dict2).items():
        if key not in mine:
            new[key] = value
        elif not (
            isinstance(mine[key], torch.Tensor)
            and isinstance(value, torch.Tensor)
            and mine[key].shape == value.shape
            and mine[key].dtype == value.dtype
            and bool(torch.equal(mine[key], value))
        ):
            raise DataProtoError(f"{key} in tensor_dict1 and tensor_dict2 are not the same object")
    for key, value in new.items():
        tensor_dict1.set(key, value)
    return tensor_dict1


def union_numpy_dict(
    tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Add the arrays of ``tensor_dict2`` to ``tensor_dict1`` (in place) and return it.

    A key in both must hold equal arrays by :func:`deep_equal` (same dtype and
    shape; NaN equals NaN; object arrays compared element by element, cycles
    allowed); all keys are checked before ``tensor_dict1`` changes.
    """
    for key, value in tensor_dict2.items():
        if key not in tensor_dict1:
            continue
        if not isinstance(value, np.ndarray) or not isinstance(tensor_dict1[key], np.ndarray):
            raise DataProtoError(f"`{key}`: union_numpy_dict compares numpy arrays only")
        if not deep_equal(tensor_dict1[key], value):
            raise DataProtoError(
                f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object. "
                "A key present in both must hold equal values."
            )
    tensor_dict1.update(tensor_dict2)
    return tensor_dict1


def deep_equal(a: Any, b: Any, _seen: set[tuple[int, int]] | None = None) -> bool:
    """Strict equality for arrays and the objects inside object arrays.

    Types, dtypes and shapes must match; NaN equals NaN (at the same place);
    a pair already being compared higher up (a cycle) counts as equal.
    """
    if type(a) is not type(b):
        return False
    seen = set() if _seen is None else _seen
    pair = (id(a), id(b))
    if pair in seen:
        return True
    seen.add(pair)
    try:
        if isinstance(a, float):
            return (math.isnan(a) and math.isnan(b)) or a == b
        if isinstance(a, np.ndarray):
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.dtype != object:
                kind = a.dtype.kind
                return bool(np.array_equal(a, b, equal_nan=kind in "fc"))
            return all(deep_equal(x, y, seen) for x, y in zip(a.flat, b.flat))
        if isinstance(a, torch.Tensor):
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(deep_equal(x, y, seen) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(deep_equal(a[k], b[k], seen) for k in a)
        try:
            return bool(a == b)
        except Exception:  # an __eq__ without a truth value
            return False
    finally:
        seen.discard(pair)


# -- folding rows -------------------------------------------------------------------


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """A DataProto of ``new_batch_size`` rows, each holding ``len(data) // new_batch_size``
    consecutive rows of ``data`` in a second dim (``[bsz, ...]`` -> ``[new_bsz, bsz // new_bsz, ...]``).

    ``data`` is not changed (verl reshapes its ``non_tensor_batch`` in place).
    """
    n = len(data)
    if not isinstance(new_batch_size, int) or new_batch_size < 1 or n % new_batch_size:
        raise DataProtoError(
            f"fold_batch_dim: a DataProto of length {n} cannot fold into {new_batch_size!r} rows"
        )
    batch = None
    if data.batch is not None:
        batch = TensorDict({}, batch_size=[new_batch_size], device=data.batch.device)
        for key, value in leaves(data.batch).items():
            batch.set(key, value.reshape(new_batch_size, -1, *value.shape[1:]))
    non_tensors = {
        k: np.reshape(v, (new_batch_size, -1, *v.shape[1:]))
        for k, v in data.non_tensor_batch.items()
    }
    return type(data)(
        batch=batch,
        non_tensor_batch=non_tensors,
        meta_info=dict(data.meta_info),
        auto_padding=data.auto_padding,
    )


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of :func:`fold_batch_dim`: merge the first ``batch_dims`` dims into the row dim."""
    if not isinstance(batch_dims, int) or batch_dims < 1:
        raise DataProtoError(f"batch_dims must be a positive int, got {batch_dims!r}")

    def rows(shape: Sequence[int]) -> int:
        if len(shape) < batch_dims:
            raise DataProtoError(
                f"unfold_batch_dim: a value of shape {list(shape)} has fewer than {batch_dims} dims"
            )
        return math.prod(shape[:batch_dims])

    batch = None
    n: int | None = None
    if data.batch is not None:
        tensors = leaves(data.batch)
        sizes = {rows(v.shape) for v in tensors.values()}
        if len(sizes) > 1:
            raise DataProtoError(
                f"unfold_batch_dim: the first {batch_dims} dims of the tensors disagree"
            )
        n = sizes.pop() if sizes else len(data)
        batch = TensorDict({}, batch_size=[n], device=data.batch.device)
        for key, value in tensors.items():
            batch.set(key, value.reshape(n, *value.shape[batch_dims:]))
    non_tensors = {}
    for key, arr in data.non_tensor_batch.items():
        m = rows(arr.shape)
        non_tensors[key] = np.reshape(arr, (m, *arr.shape[batch_dims:]))
    return type(data)(
        batch=batch,
        non_tensor_batch=non_tensors,
        meta_info=dict(data.meta_info),
        auto_padding=data.auto_padding,
    )


# -- serialization -------------------------------------------------------------------


def serialize_single_tensor(obj: torch.Tensor) -> SerializedTensor:
    """``(dtype name, shape, uint8 numpy array of its bytes)`` of a (CPU copy of a) tensor."""
    flat = obj.detach().cpu().flatten().contiguous()
    dtype = str(obj.dtype).removeprefix("torch.")
    return dtype, tuple(obj.shape), flat.view(torch.uint8).numpy()


def deserialize_single_tensor(arr: Sequence[Any]) -> torch.Tensor:
    """Inverse of :func:`serialize_single_tensor`; the tensor owns a copy of the bytes."""
    dtype_name, shape, data = arr
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise DataProtoError(f"unknown tensor dtype {dtype_name!r} in a serialized tensor")
    raw = bytearray(memoryview(data).cast("B"))
    if not raw:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(tuple(shape))


def serialize_tensordict(
    batch: TensorDictBase,
) -> tuple[tuple[int, ...], str | None, dict[Any, Any]]:
    """``(batch_size, device, {key: record})`` where a record is a serialized tensor, or
    ``(layout, [serialized tensors])`` for a nested tensor. Nested keys stay tuples."""
    items: dict[Any, Any] = {}
    for key, value in leaves(batch).items():
        if not isinstance(value, torch.Tensor):
            raise DataProtoError(
                f"serialize_tensordict handles tensors only; {key!r} is a {type(value).__name__}"
            )
        if value.is_nested:
            layout = str(value.layout).removeprefix("torch.")
            items[key] = (layout, [serialize_single_tensor(t) for t in value.unbind()])
        else:
            items[key] = serialize_single_tensor(value)
    device = str(batch.device) if batch.device is not None else None
    return tuple(batch.batch_size), device, items


def deserialize_tensordict(arr: Sequence[Any]) -> TensorDict:
    """Inverse of :func:`serialize_tensordict`."""
    batch_size, device, items = arr
    out = TensorDict({}, batch_size=list(batch_size), device=device)
    for key, record in items.items():
        if len(record) == 3:
            value = deserialize_single_tensor(record)
        elif len(record) == 2:
            layout, parts = record
            value = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(p) for p in parts], layout=getattr(torch, layout)
            )
        else:
            raise DataProtoError(
                f"invalid serialized tensor for {key!r}: expected 2 or 3 fields, got {len(record)}"
            )
        out.set(key, value.to(device) if device is not None else value)
    return out


# -- rows and process groups ---------------------------------------------------------


def collate_fn(x: Sequence[DataProtoItem]) -> DataProto:
    """Stack :class:`DataProtoItem` rows (``data[i]``) into one DataProto (a ``DataLoader`` collate)."""
    items = list(x)
    if not items:
        raise DataProtoError("collate_fn needs at least one DataProtoItem")
    batches = [item.batch for item in items]
    batch = None
    if any(b is not None for b in batches):
        if any(b is None for b in batches):
            raise DataProtoError("collate_fn: some items have a batch and some do not")
        stacked: Any = torch.stack(batches)  # type: ignore[arg-type]  # TensorDicts stack to one
        batch = stacked.contiguous()
    non_tensors = {
        key: object_array([item.non_tensor_batch[key] for item in items])
        for key in items[0].non_tensor_batch
    }
    return DataProto(batch=batch, non_tensor_batch=non_tensors)


def all_gather_data_proto(data: DataProto, process_group: Any) -> None:
    """In place, as ``torch.distributed.all_gather``: ``data`` becomes the rows of every rank
    of ``process_group``, in rank order (tensors and non-tensors; ``meta_info`` stays).

    Every rank must pass a DataProto of the same length and keys; a length that
    differs raises :class:`DataProtoError` on every rank (never a hang).
    Tensors travel on the device the group's backend needs (CUDA for NCCL) and
    come back to where they were.
    """
    import torch.distributed as dist

    if not isinstance(data, DataProto):
        raise TypeError(f"all_gather_data_proto needs a DataProto, got {type(data).__name__}")
    size = dist.get_world_size(group=process_group)
    backend = str(dist.get_backend(process_group)).lower()
    comm = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    lengths: list[Any] = [None] * size
    dist.all_gather_object(lengths, len(data), group=process_group)
    if len(set(lengths)) != 1:
        raise DataProtoError(
            f"all_gather_data_proto needs the same length on every rank, got {lengths}"
        )
    if data.batch is not None:
        prev = data.batch.device
        gathered = TensorDict({}, batch_size=[len(data) * size], device=prev)
        for key, value in leaves(data.batch).items():
            local = value.to(comm).contiguous()
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local, group=process_group)
            joined = torch.cat(parts, dim=0)
            gathered.set(key, joined.to(prev) if prev is not None else joined.to(value.device))
        data.batch = gathered
    objects: list[Any] = [None] * size
    dist.all_gather_object(objects, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {
        key: np.concatenate([part[key] for part in objects]) for key in data.non_tensor_batch
    }
    data.check_consistency()
