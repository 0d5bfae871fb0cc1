"""Helpers of :mod:`podium.core.protocol`: value coercion, equality, index normalization."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase

from podium.errors import DataProtoError

Key: TypeAlias = "str | tuple[str, ...]"


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array holding ``values`` as they are (no nested-list promotion)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def as_array(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise DataProtoError(
                f"non_tensor_batch[{key!r}] is a 0-d array; it needs a first dimension "
                "of size N (put per-batch values in meta_info)"
            )
        return value
    if isinstance(value, (list, tuple)):
        return object_array(value)
    raise TypeError(
        f"non_tensor_batch[{key!r}] must be a numpy array or a list, got {type(value).__name__}"
        + (" (tensors belong in batch)" if isinstance(value, torch.Tensor) else "")
    )


def values_equal(a: Any, b: Any) -> bool:
    """Equality that works for tensors, arrays (incl. object arrays) and plain values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.flat, b.flat))
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an __eq__ that returns something without a truth value
        return False


def leaves(td: TensorDictBase, prefix: tuple[str, ...] = ()) -> dict[Key, Any]:
    """Flatten ``td`` to ``{key: leaf}``; top-level keys are str, nested ones tuples.

    Non-tensor entries (NonTensorData/Stack) are leaves too.
    """
    out: dict[Key, Any] = {}
    for name in td.keys():
        value = td.get(name)
        key = (*prefix, name)
        if isinstance(value, TensorDictBase) and not isinstance(
            value, (NonTensorData, NonTensorStack)
        ):
            out.update(leaves(value, key))
        else:
            out[key[0] if len(key) == 1 else key] = value
    return out


def check_index_bounds(arr: np.ndarray, length: int) -> np.ndarray:
    if arr.size and (arr.min() < -length or arr.max() >= length):
        bad = arr[(arr < -length) | (arr >= length)][0]
        raise IndexError(f"index {int(bad)} is out of range for a DataProto of length {length}")
    return np.where(arr < 0, arr + length, arr).astype(np.int64, copy=False)


def normalize_index(index: Any, length: int) -> slice | np.ndarray:
    """A non-negative int64 index array, or a slice with a positive step (a view)."""
    if isinstance(index, slice):
        if index.step is not None and index.step < 0:
            return np.arange(length)[index].copy()  # torch cannot slice backwards
        return index
    if isinstance(index, torch.Tensor):
        arr = index.detach().cpu().numpy()
    else:
        arr = np.asarray(index)
    if arr.ndim != 1:
        raise IndexError(f"a DataProto index must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype == bool:
        if arr.shape[0] != length:
            raise IndexError(
                f"boolean mask has length {arr.shape[0]} but the DataProto has length {length}"
            )
        return np.flatnonzero(arr)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"a DataProto index must hold ints or bools, got dtype {arr.dtype}")
    return check_index_bounds(arr, length)


def as_key_list(keys: str | Sequence[str] | None, what: str) -> list[str]:
    if keys is None:
        return []
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, Sequence):
        raise TypeError(f"{what} must be a list of str, got {type(keys).__name__}")
    return list(keys)


def missing(keys: Sequence[Any], available: Any, where: str) -> None:
    available = list(available)
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(f"{where} has no key(s) {missing}; available: {sorted(map(str, available))}")


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__


def tensor_shapes(tensors: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Size]:
    out: dict[str, torch.Size] = {}
    for key, value in tensors.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value.shape
        elif isinstance(value, Mapping):
            out.update(tensor_shapes(value, f"{name}."))
        else:
            raise TypeError(
                f"tensors[{name!r}] must be a tensor, got {type(value).__name__} "
                "(non-tensor values go in non_tensors)"
            )
    return out


def is_metrics(value: Any) -> bool:
    """A ``metrics`` meta value concat merges: a dict, or a list of dicts."""
    if isinstance(value, list):
        return all(isinstance(v, dict) for v in value)
    return isinstance(value, dict)


def merge_checked(into: dict[str, Any], other: Mapping[str, Any], where: str) -> None:
    for key, value in other.items():
        if key in into:
            if not values_equal(into[key], value):
                raise DataProtoError(f"union: {where} key {key!r} differs between the two DataProtos")
        else:
            into[key] = value
