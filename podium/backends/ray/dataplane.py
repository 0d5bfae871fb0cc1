"""The data plane on Ray: an exported shard is one object in Ray's object store.

The producer ``ray.put`` s the shard's flat buffer (see
:class:`podium.core.dataplane.Layout`) and keeps the reference; the
:class:`RayTransport` travels inside the ``BatchRef`` as a real ``ObjectRef``
in the payload's reference list (:mod:`podium.backends.ray.wire`), so Ray
counts the controller and every consumer as borrowers and never resolves it on
the way. A consumer ``ray.get`` s the buffer -- zero-copy from the object store
on its node -- and copies out only its rows of the keys it asked for. The
object is freed when the producer has released it and no ``BatchRef`` at the
controller names it; a producer that died takes its objects with it
(``OwnerDiedError``), which a reader reports as :class:`podium.errors.DataLostError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray.exceptions import ObjectLostError, RayActorError
from tensordict import TensorDict, TensorDictBase

from podium.backends.ray import wire
from podium.core._batch_utils import Key
from podium.core.dataplane import Exporter, Layout, ShardInfo, Transport, read_buffer
from podium.core.protocol import DataProto
from podium.errors import DataLostError

__all__ = ["RayExporter", "RayTransport"]


class RayTransport(Transport):
    """One shard's ``ObjectRef``."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def __reduce__(self) -> Any:
        index = wire.stash_ref(self.ref) if self.ref is not None else None
        if index is None:  # pickled by Ray itself (or released): Ray handles the ref
            return (RayTransport, (self.ref,))
        return (_from_payload, (index,))

    def read(
        self,
        info: ShardInfo,
        rows: np.ndarray,
        keys: Sequence[Key],
        objects: Sequence[str],
        meta_info: dict[str, Any],
    ) -> DataProto | TensorDict:
        ref = self.ref
        if ref is None:
            raise DataLostError(info.shard_id, None, detail="it was released (release())")
        try:
            buf = ray.get(ref)
        except (ObjectLostError, RayActorError) as exc:
            detail = " ".join(str(exc).split())[:300]
            raise DataLostError(
                info.shard_id, None, detail=f"its producer is gone ({detail})"
            ) from None
        return read_buffer(
            info.layout, buf, rows, keys, objects, meta_info, writable=bool(buf.flags.writeable)
        )

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
        buf = np.empty(layout.nbytes, dtype=np.uint8)
        write(buf)
        ref = ray.put(buf)
        return RayTransport(ref), ref, data
