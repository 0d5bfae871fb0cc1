"""The data plane on torchrun: an exported shard is one shared-memory segment of its producer.

The producer writes the shard's flat buffer (see
:class:`podium.core.dataplane.Layout`) once into a ``/dev/shm`` segment named
with its rank's prefix, and keeps tensors that are views of that segment (so
the shard costs its memory once). A consumer on the same host maps the
segment copy-on-write (``MAP_PRIVATE``) and builds its tensors on the mapping:
consecutive rows are read without a copy, and a consumer never sees another
reader's writes. The controller never touches the bytes.

The segment is removed when the controller releases the shard, when the
worker stops, and -- by the rank's supervisor, within milliseconds -- when the
worker dies; a reader that finds it gone raises
:class:`podium.errors.DataLostError`. Readers on another host cannot map it:
this backend reads shards only on the producer's host.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tensordict import TensorDict, TensorDictBase

from podium.backends.torchrun.shm import SHM_DIR, Segment
from podium.core._batch_utils import Key
from podium.core.dataplane import Exporter, Layout, ShardInfo, Transport, read_buffer
from podium.core.protocol import DataProto
from podium.errors import DataLostError, PodiumError

__all__ = ["ShmExporter", "ShmTransport"]


class ShmTransport(Transport):
    """A shard's segment: its name, its host and its size."""

    def __init__(self, name: str, host: str, nbytes: int) -> None:
        self.name = name
        self.host = host
        self.nbytes = nbytes
        self.released = False

    def __reduce__(self) -> Any:
        return (ShmTransport, (self.name, self.host, self.nbytes))

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
        if socket.gethostname() != self.host:
            raise PodiumError(
                f"a BatchRef's rows live in shared memory on host {self.host!r} and cannot be read on "
                f"{socket.gethostname()!r}: on torchrun, pass BatchRefs between groups on one host, "
                "or materialize() them at the controller"
            )
        try:
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDONLY)
        except FileNotFoundError:
            raise DataLostError(
                info.shard_id,
                None,
                detail="its producer's shared memory is gone (the worker ended)",
            ) from None
        try:
            mapping = mmap.mmap(
                fd, self.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        buf = np.frombuffer(mapping, dtype=np.uint8)
        return read_buffer(info.layout, buf, rows, keys, objects, meta_info, writable=True)

    def drop(self) -> None:
        self.released = True


class ShmExporter(Exporter):
    """Writes each exported shard into a segment named ``{prefix}x{n}`` (the rank's prefix)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.host = socket.gethostname()
        self._count = itertools.count()

    def export(
        self,
        shard_id: str,
        data: DataProto | TensorDictBase,
        layout: Layout,
        write: Callable[[np.ndarray], None],
    ) -> tuple[Transport, Any, DataProto | TensorDictBase]:
        size = max(layout.nbytes, mmap.PAGESIZE)
        seg = Segment(f"{self.prefix}x{next(self._count)}", size)
        buf = np.frombuffer(seg.map, dtype=np.uint8)
        write(buf)
        # Keep views of the segment, not the output: the shard's memory counts once.
        meta = dict(data.meta_info) if isinstance(data, DataProto) else {}
        rows = np.arange(layout.nrows, dtype=np.int64)
        local = read_buffer(
            layout, buf, rows, [c.key for c in layout.columns], layout.objects, meta, writable=True
        )
        if isinstance(local, DataProto) and isinstance(data, DataProto):
            local.auto_padding = data.auto_padding
        return ShmTransport(seg.name, self.host, size), seg, local

    def free(self, handle: Any) -> None:
        handle.close()
