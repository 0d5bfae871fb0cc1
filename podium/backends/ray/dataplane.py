"""The data plane on Ray: an exported shard is one object in Ray's object store.

The producer ``ray.put`` s the shard as a list: one ``uint8`` array per tensor
key (the tensor's own memory, in :class:`podium.core.dataplane.Layout` column
order) and the non-tensor columns last. Ray writes each array into the object
store out of band, so exporting costs one copy of the shard, the one into the
store. The :class:`RayTransport` travels inside the ``BatchRef`` as a real
``ObjectRef`` in the payload's reference list (:mod:`podium.backends.ray.wire`),
so Ray counts the controller and every consumer as borrowers and never
resolves it on the way. A consumer ``ray.get`` s the object -- zero-copy from
the object store on its node -- and copies out only its rows of the keys it
asked for, once: when its rows come from several shards they are read as
views of the store and copied only where they are joined. The object is freed
when the producer has released it and no ``BatchRef`` at the controller names
it; a producer that died takes its objects with it (``OwnerDiedError``), which
a reader reports as :class:`podium.errors.DataLostError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import ObjectLostError, RayActorError
from tensordict import TensorDict, TensorDictBase

from podium.backends.ray import wire
from podium.core._batch_utils import Key
from podium.core.dataplane import (
    Exporter,
    Layout,
    ShardInfo,
    Transport,
    _build,
    _rows_slice,
    _tensors_of,
)
from podium.core.protocol import DataProto
from podium.errors import DataLostError

__all__ = ["RayExporter", "RayTransport", "columns_of", "read_columns"]


class RayTransport(Transport):
    """One shard's ``ObjectRef``."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def __reduce__(self) -> Any:
        index = wire.stash_ref(self.ref) if self.ref is not None else None
        if index is None:  # pickled by Ray itself (or released): Ray handles the ref
            return (RayTransport, (self.ref,))
        return (_from_payload, (index,))

    # read(copy=False) gives read-only views of the object store (the caller joins them).
    reads_views = True

    def read(
        self,
        info: ShardInfo,
        rows: np.ndarray,
        keys: Sequence[Key],
        objects: Sequence[str],
        meta_info: dict[str, Any],
        *,
        copy: bool = True,
    ) -> DataProto | TensorDict:
        ref = self.ref
        if ref is None:
            raise DataLostError(info.shard_id, None, detail="it was released (release())")
        try:
            stored = ray.get(ref)
        except (ObjectLostError, RayActorError) as exc:
            detail = " ".join(str(exc).split())[:300]
            raise DataLostError(
                info.shard_id, None, detail=f"its producer is gone ({detail})"
            ) from None
        return read_columns(info.layout, stored, rows, keys, objects, meta_info, copy=copy)

    def drop(self) -> None:
        self.ref = None


def _from_payload(index: int) -> RayTransport:
    return RayTransport(wire.take_ref(index))


class RayExporter(Exporter):
    """Puts each exported shard into the object store once; keeps the output for colocated readers."""

    def export(
        self,
        shard_id: str,
        data: DataProto | TensorDictBase,
        layout: Layout,
        write: Callable[[np.ndarray], None],
    ) -> tuple[Transport, Any, DataProto | TensorDictBase]:
        ref = ray.put(columns_of(data, layout))
        return RayTransport(ref), ref, data


def columns_of(data: DataProto | TensorDictBase, layout: Layout) -> list[Any]:
    """What a shard's object holds: each tensor key's bytes (a view, no copy), then the
    non-tensor columns (a dict; None when there are none)."""
    tensors, objects, _ = _tensors_of(data)
    out: list[Any] = []
    for col in layout.columns:
        t = tensors[col.key].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        out.append(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    out.append({k: objects[k] for k in layout.objects} if layout.objects else None)
    return out


def read_columns(
    layout: Layout,
    stored: Sequence[Any],
    rows: np.ndarray,
    keys: Sequence[Key],
    objects: Sequence[str],
    meta_info: dict[str, Any],
    *,
    copy: bool,
) -> DataProto | TensorDict:
    """Rows ``rows`` of ``keys`` (and non-tensor ``objects``) from a shard's stored columns.

    The stored arrays are read-only pages of the object store: the rows are
    copied once into ordinary memory, unless ``copy`` is False and they are
    consecutive -- then the result holds read-only views, for a caller that
    copies them anyway (joining the rows of several shards).
    """
    m = int(rows.size)
    sl = _rows_slice(rows)
    position = {col.key: i for i, col in enumerate(layout.columns)}
    tensors: dict[Key, torch.Tensor] = {}
    for key in keys:
        i = position[key]
        col = layout.columns[i]
        if col.row_bytes == 0:
            tensors[key] = torch.empty((m, *col.row_shape), dtype=col.dtype)
            continue
        block = stored[i].reshape(layout.nrows, col.row_bytes)
        if sl is None:
            part = block[rows]  # scattered rows: numpy copies them
        elif copy:
            part = np.array(block[sl])
        else:
            part = block[sl]
        if part.flags.writeable:
            tensor = torch.from_numpy(part)
        else:
            with warnings.catch_warnings():  # the views are joined (copied) before anyone writes
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(part)
        tensors[key] = tensor.view(col.dtype).reshape(m, *col.row_shape)
    non_tensors: dict[str, np.ndarray] = {}
    if objects:
        held = stored[len(layout.columns)]
        index: slice | np.ndarray = sl if sl is not None else rows
        non_tensors = {k: held[k][index].copy() for k in objects}
    return _build(layout.kind, tensors, non_tensors, m, meta_info)
