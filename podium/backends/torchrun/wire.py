"""The control channel's message layout, shared by the controller and the workers.

Every message is a ZeroMQ multipart message ``[head, *frames]``: ``head`` is
one byte of kind (the constants below) followed by ``meta`` in msgpack (plain
values, lists -- which come back as tuples -- and dicts; never pickle, so
reading a head runs no code whoever sent it), and ``frames`` the serialized
objects the message carries. An object is carried

- **in meta** when it is a plain value (``None``, a number, a short string, or
  a successful ``Outcome`` of one, sent as the value alone: ``("o", value)``) or a small pickle without out-of-band buffers: a no-op
  call and its reply are then one frame each way -- with CURVE every frame is
  encrypted on its own, and each costs a few microseconds per hop;
- **inline** (its pickle header, then one frame per out-of-band buffer, sent
  without copying);
- or through **shared memory** (its header, with the buffers in a segment
  that ``meta`` names; see :mod:`.shm`).

Inline buffers larger than ``CHUNK_BYTES`` are cut into frames of that size
and joined by the reader: ZeroMQ encrypts each frame into two fresh buffers,
so one 1 GiB frame costs the sender three times its size at once, 16 MiB
frames a few tens of MiB more than the data. (The reader holds the received
frames and the joined copy: twice the size, where one frame costs it once.) When shared memory is full the
traffic that does not fit goes inline, and the first time that happens in a
process a warning says so (once: the socket keeps working, only slower).

Only the controller and the workers of one group can exchange messages: the
socket is CURVE-encrypted and the controller admits only the group's keys,
each for its own rank. Objects (``frames``, and ``("b", ...)`` in ``meta``)
are cloudpickled: they are unpickled only once they came from such a peer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from podium.backends.torchrun.shm import (
    Segment,
    SegmentMap,
    SegmentPool,
    packed_size,
    write_buffers,
)
from podium.core.host import Outcome
from podium.core.serialization import dumps, loads

__all__ = [
    "Encoded",
    "decode_objects",
    "done_placing",
    "encode",
    "head",
    "place",
    "split_head",
]

# worker -> controller
HELLO = b"H"  # a worker connected: its rank, pid, host
READY = b"R"  # the user's constructor ran (meta: outcome)
RESULT = b"r"  # one call's outcome
# supervisor -> controller
BEAT = b"B"  # the supervisor (and so its worker) is alive
LOG = b"L"  # lines the worker wrote (head: LOG + b"1" or b"2", then one frame of bytes)
EXIT = b"X"  # the worker process ended: exit code / signal, last lines
STALL = b"T"  # the worker is stopped (state T): head is STALL + seconds stopped, in ASCII
# controller -> worker
INIT = b"I"  # build the user's worker
CALL = b"C"  # run one method
FREE = b"F"  # segments the controller no longer reads
STOP = b"S"  # exit cleanly
# The two messages of a call without arguments that returns None (most control
# calls: init_model, sync, save) in a fixed layout, read without msgpack.
CALL_BARE = b"c"  # a CALL with no objects and nothing freed: + call id (8 bytes LE) + target (UTF-8)
RESULT_NONE = b"n"  # worker -> controller: a RESULT of None, nothing released: + call id (8 bytes LE)
# controller -> supervisor
PING = b"P"  # the controller is alive
CANCEL = b"K"  # interrupt a call if it still runs: head is CANCEL + its call id, in ASCII
QUIT = b"Q"  # the group stops: interrupt the running call, skip queued ones (head: QUIT + grace s)

# Objects with at least this many out-of-band bytes go through shared memory
# when the peer is on this host; below it the socket is faster.
SHM_MIN_BYTES = 256 * 1024
# Frames at least this large are handed to ZeroMQ without a copy.
ZERO_COPY_MIN = 64 * 1024
# Pickles without out-of-band buffers up to this size travel inside ``meta``.
IN_META_MAX = 16 * 1024
# Inline buffers are sent in frames of at most this many bytes.
CHUNK_BYTES = 16 << 20

log = logging.getLogger("podium.torchrun")
_warned_shm_full = False

# Values that msgpack carries exactly (ints within 64 bits), so they ride in
# ``meta`` directly, with neither side pickling anything.
_PLAIN = (type(None), bool, int, float, str, bytes)
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def head(kind: bytes, meta: Any = None) -> bytes:
    """A message's first frame: its kind, then ``meta`` in msgpack (if any)."""
    if meta is None:
        return kind
    return kind + msgpack.packb(meta, use_bin_type=True, unicode_errors="surrogatepass")


def bare_call(call_id: int, target: str) -> bytes:
    """The head of a call with no arguments (:data:`CALL_BARE`)."""
    return CALL_BARE + call_id.to_bytes(8, "little") + target.encode()


def split_bare_call(buf: bytes) -> tuple[int, str]:
    """``(call id, target)`` of a :data:`CALL_BARE` head."""
    if len(buf) < 10:
        raise ValueError(f"malformed {buf[:1]!r} message head: {len(buf)} bytes")
    return int.from_bytes(buf[1:9], "little"), buf[9:].decode()


def result_none(call_id: int) -> bytes:
    """The head of a reply that says call ``call_id`` returned None (:data:`RESULT_NONE`)."""
    return RESULT_NONE + call_id.to_bytes(8, "little")


def split_head(frame: Any) -> tuple[bytes, Any]:
    """Inverse of :func:`head` for a received frame (``bytes`` or a ``zmq.Frame``).

    Sequences in ``meta`` come back as tuples. A head that is not msgpack is a
    ``ValueError``.
    """
    buf = frame if isinstance(frame, bytes) else frame.bytes
    if len(buf) == 1:
        return buf, None
    try:
        meta = msgpack.unpackb(
            memoryview(buf)[1:], use_list=False, raw=False, unicode_errors="surrogatepass"
        )
    except Exception as exc:  # msgpack's errors are not all ValueErrors
        raise ValueError(f"malformed {buf[:1]!r} message head: {exc}") from None
    return buf[:1], meta


def _plain(obj: Any) -> bool:
    t = type(obj)
    if t is int:
        return _INT_MIN <= obj <= _INT_MAX  # what msgpack holds
    if t in _PLAIN:
        return not isinstance(obj, (str, bytes)) or len(obj) <= IN_META_MAX
    if t is Outcome:
        return bool(obj.ok) and _plain(obj.value)
    return False


@dataclass
class Encoded:
    """One object serialized once, to be sent to one or more peers."""

    header: bytes
    buffers: list[memoryview]
    nbytes: int
    shared: tuple[Segment, list[tuple[int, int]]] | None = field(default=None)
    plain: tuple[Any] | None = None  # (value,) for a value that travels in meta


def encode(obj: Any) -> Encoded:
    if _plain(obj):
        # cloudpickle's pickler costs ~5 us to build per call; a plain value needs none.
        return Encoded(b"", [], 0, plain=(obj,))
    header, pbufs = dumps(obj)
    views = [b.raw() for b in pbufs]
    return Encoded(header, views, sum(v.nbytes for v in views))


# How a successful ``None`` outcome travels (what ``place`` gives for it).
OK_NONE = ("o", None)


def place(enc: Encoded, pool: SegmentPool | None) -> tuple[tuple[Any, ...], list[Any]]:
    """How ``enc`` travels to one peer: a descriptor for ``meta`` and its frames.

    With a ``pool`` (the peer shares this host) large objects are copied into
    shared memory once, however many peers receive them.
    """
    if enc.plain is not None:
        value = enc.plain[0]
        if type(value) is Outcome:
            # A successful plain outcome (most replies): its value alone, so
            # neither side pickles a dataclass instance.
            return ("o", value.value), []
        return ("v", value), []
    if not enc.buffers and len(enc.header) <= IN_META_MAX:
        return ("b", enc.header), []
    if pool is not None and enc.nbytes >= SHM_MIN_BYTES:
        if enc.shared is None:
            try:
                seg = pool.acquire(packed_size(enc.buffers))
            except OSError as exc:
                seg = None  # /dev/shm full or unavailable: the socket still works
                _warn_shm_full(enc.nbytes, exc)
            if seg is not None:
                enc.shared = (seg, write_buffers(seg, enc.buffers))
                # The builder's own reference, dropped by done_placing once
                # every peer's is held: a peer that releases early must not
                # free the segment while it is still being handed out.
                pool.hold(seg)
        if enc.shared is not None:
            seg, places = enc.shared
            pool.hold(seg)
            return ("s", seg.name, places), [enc.header]
    if enc.nbytes <= CHUNK_BYTES or all(b.nbytes <= CHUNK_BYTES for b in enc.buffers):
        return ("i", len(enc.buffers)), [enc.header, *enc.buffers]
    frames: list[Any] = [enc.header]
    counts = []
    for buf in enc.buffers:
        pieces = [buf[i : i + CHUNK_BYTES] for i in range(0, buf.nbytes, CHUNK_BYTES)] or [buf]
        counts.append((len(pieces), buf.nbytes))
        frames.extend(pieces)
    return ("c", counts), frames


def _warn_shm_full(nbytes: int, exc: OSError) -> None:
    global _warned_shm_full
    if _warned_shm_full:
        return
    _warned_shm_full = True
    log.warning(
        "shared memory has no room for a %.1f MiB message (%s): it and any later one that does not "
        "fit go through the socket, which is slower and needs more memory. Give /dev/shm more room "
        "(docker run --shm-size, a larger tmpfs) or free some of it. (Logged once per process.)",
        nbytes / 2**20,
        exc,
    )


def done_placing(enc: Encoded, pool: SegmentPool | None) -> None:
    """``enc`` was placed for every peer that gets it: drop the builder's reference."""
    if enc.shared is not None and pool is not None:
        pool.release([enc.shared[0].name])


def decode_objects(
    descs: list[tuple[Any, ...]], frames: list[Any], segments: SegmentMap
) -> list[Any]:
    """Inverse of :func:`place` for a message's objects, in order."""
    out = []
    i = 0
    for desc in descs:
        kind = desc[0]
        if kind == "v":
            out.append(desc[1])
            continue
        if kind == "o":
            out.append(Outcome(True, desc[1]))
            continue
        if desc[0] == "b":
            out.append(loads(desc[1]))
            continue
        header = frames[i]
        i += 1
        if desc[0] == "i":
            n = desc[1]
            buffers: list[Any] = frames[i : i + n]
            i += n
        elif desc[0] == "c":
            buffers = []
            for count, nbytes in desc[1]:
                buffers.append(frames[i] if count == 1 else _join(frames[i : i + count], nbytes))
                frames[i : i + count] = [None] * count  # the caller's last references, if its list
                i += count
        else:
            buffers = list(segments.views(desc[1], desc[2]))
        out.append(loads(header, buffers))
    return out


def _join(pieces: Any, nbytes: int) -> np.ndarray:
    """One buffer of ``nbytes`` from the frames ``pieces`` yields, each dropped once copied."""
    out = np.empty(nbytes, dtype=np.uint8)
    off = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        n = view.nbytes
        if off + n > nbytes:
            raise ValueError(f"chunked buffer larger than the {nbytes} bytes announced")
        out[off : off + n] = np.frombuffer(view, dtype=np.uint8)
        off += n
        view.release()
        del piece
    if off != nbytes:
        raise ValueError(f"chunked buffer of {off} bytes, {nbytes} announced")
    return out


def is_zero_copy(frame: Any) -> bool:
    if type(frame) is bytes:  # the common case: heads and small headers
        return len(frame) >= ZERO_COPY_MIN
    try:
        return memoryview(frame).nbytes >= ZERO_COPY_MIN
    except TypeError:
        return False
