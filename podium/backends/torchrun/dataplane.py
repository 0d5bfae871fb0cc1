"""The data plane on torchrun: an exported shard is one shared-memory segment of its producer.

The producer writes the shard's flat buffer (see
:class:`podium.core.dataplane.Layout`) once into a ``/dev/shm`` segment named
with its rank's prefix, and keeps tensors that are views of that segment (so
the shard costs its memory once). How a reader gets the rows it needs:

- **on the producer's host**: it maps the segment copy-on-write
  (``MAP_PRIVATE``) and builds its tensors on the mapping: consecutive rows are
  read without a copy, and a reader never sees another reader's writes.
- **on another host**: it asks the producer's shard server
  (:mod:`.shardserver`, CURVE-authenticated: only ranks of this controller's
  groups, and the controller, may read) for exactly its rows and keys, sliced
  at the producer. The ``shard_network`` backend option makes readers take
  this path on the producer's host too (tests, benchmarks).

The controller never touches the bytes, except in ``materialize()``. The
segment is removed when the controller releases the shard, when the worker
stops, and -- by the rank's supervisor, within milliseconds -- when the worker
dies; a reader that finds it gone, or a shard server that refuses connections
or drops them, raises :class:`podium.errors.DataLostError`.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tensordict import TensorDict, TensorDictBase

from podium.backends.torchrun.shm import SHM_DIR, Segment
from podium.core._batch_utils import Key
from podium.core.dataplane import Exporter, Layout, ShardInfo, Transport, read_buffer
from podium.core.protocol import DataProto
from podium.errors import DataLostError, PodiumError

__all__ = ["NETWORK_ENV", "ShmExporter", "ShmTransport"]

# Set to "1" in a process whose reads must go through the producers' shard servers
# even on the producer's host (the ``shard_network`` backend option sets it in workers).
NETWORK_ENV = "PODIUM_TR_SHARD_NETWORK"


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
        here = socket.gethostname() == self.host and os.environ.get(NETWORK_ENV) != "1"
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


ServerFactory = Callable[[Callable[[str], "tuple[np.ndarray, Layout] | None"]], Any]


class ShmExporter(Exporter):
    """Writes each exported shard into a segment named ``{prefix}x{n}`` (the rank's prefix).

    With a ``server`` factory, the first export starts this worker's shard
    server (see :mod:`.shardserver`), which serves the segments exported here
    until they are freed.
    """

    def __init__(self, prefix: str, server: ServerFactory | None = None) -> None:
        self.prefix = prefix
        self.host = socket.gethostname()
        self._count = itertools.count()
        self._server_factory = server
        self._server: Any = None
        self._lock = threading.Lock()
        self._served: dict[str, tuple[np.ndarray, Layout]] = {}

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
        endpoint, server_key = "", b""
        server = self._serve()
        if server is not None:
            with self._lock:
                self._served[seg.name] = (buf, layout)
            endpoint, server_key = server.endpoint, server.public_key
        return ShmTransport(seg.name, self.host, size, endpoint, server_key), seg, local

    def _serve(self) -> Any:
        if self._server is None and self._server_factory is not None:
            self._server = self._server_factory(self._lookup)
        return self._server

    def _lookup(self, name: str) -> tuple[np.ndarray, Layout] | None:
        with self._lock:
            return self._served.get(name)

    def free(self, handle: Any) -> None:
        with self._lock:
            self._served.pop(handle.name, None)
        handle.close()

    def close(self) -> None:
        """Stop the shard server (the worker is ending)."""
        with self._lock:
            self._served.clear()
        if self._server is not None:
            self._server.close()
