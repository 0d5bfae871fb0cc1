"""The control channel's message layout, shared by the controller and the workers.

Every message is a ZeroMQ multipart message ``[kind, meta, *frames]``:
``kind`` is one of the constants below, ``meta`` a small pickle, and
``frames`` the serialized objects the message carries. An object is carried
either **inline** (its pickle header, then one frame per out-of-band buffer,
sent without copying) or through **shared memory** (its header, with the
buffers in a segment that ``meta`` names; see :mod:`.shm`).

Only the controller and the workers of one group can exchange messages: the
socket is CURVE-encrypted and the controller admits only the group's key.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from podium.backends.torchrun.shm import (
    Segment,
    SegmentMap,
    SegmentPool,
    packed_size,
    write_buffers,
)
from podium.core.serialization import dumps, loads

__all__ = ["Encoded", "decode_objects", "encode", "pack_meta", "place", "unpack_meta"]

# worker -> controller
HELLO = b"hello"  # a worker connected: its rank, pid, host
READY = b"ready"  # the user's constructor ran (meta: outcome)
RESULT = b"result"  # one call's outcome
# supervisor -> controller
BEAT = b"beat"  # the supervisor (and so its worker) is alive
LOG = b"log"  # lines the worker wrote to stdout/stderr
EXIT = b"exit"  # the worker process ended: exit code / signal, last lines
# controller -> worker
INIT = b"init"  # build the user's worker
CALL = b"call"  # run one method
FREE = b"free"  # segments the controller no longer reads
STOP = b"stop"  # exit cleanly
# controller -> supervisor
PING = b"ping"  # the controller is alive

# Objects with at least this many out-of-band bytes go through shared memory
# when the peer is on this host; below it the socket is faster.
SHM_MIN_BYTES = 256 * 1024
# Frames at least this large are handed to ZeroMQ without a copy.
ZERO_COPY_MIN = 64 * 1024


def pack_meta(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def unpack_meta(data: Any) -> Any:
    return pickle.loads(data)


@dataclass
class Encoded:
    """One object serialized once, to be sent to one or more peers."""

    header: bytes
    buffers: list[memoryview]
    nbytes: int
    shared: tuple[Segment, list[tuple[int, int]]] | None = field(default=None)


def encode(obj: Any) -> Encoded:
    header, pbufs = dumps(obj)
    views = [b.raw() for b in pbufs]
    return Encoded(header, views, sum(v.nbytes for v in views))


def place(enc: Encoded, pool: SegmentPool | None) -> tuple[tuple[Any, ...], list[Any]]:
    """How ``enc`` travels to one peer: a descriptor for ``meta`` and its frames.

    With a ``pool`` (the peer shares this host) large objects are copied into
    shared memory once, however many peers receive them.
    """
    if pool is not None and enc.nbytes >= SHM_MIN_BYTES:
        if enc.shared is None:
            try:
                seg = pool.acquire(packed_size(enc.buffers))
            except OSError:
                seg = None  # /dev/shm full or unavailable: the socket still works
            if seg is not None:
                enc.shared = (seg, write_buffers(seg, enc.buffers))
        if enc.shared is not None:
            seg, places = enc.shared
            pool.hold(seg)
            return ("s", seg.name, places), [enc.header]
    return ("i", len(enc.buffers)), [enc.header, *enc.buffers]


def decode_objects(
    descs: list[tuple[Any, ...]], frames: list[Any], segments: SegmentMap
) -> list[Any]:
    """Inverse of :func:`place` for a message's objects, in order."""
    out = []
    i = 0
    for desc in descs:
        header = frames[i]
        i += 1
        if desc[0] == "i":
            n = desc[1]
            buffers: list[Any] = frames[i : i + n]
            i += n
        else:
            buffers = list(segments.views(desc[1], desc[2]))
        out.append(loads(header, buffers))
    return out


def is_zero_copy(frame: Any) -> bool:
    try:
        return memoryview(frame).nbytes >= ZERO_COPY_MIN
    except TypeError:
        return False
