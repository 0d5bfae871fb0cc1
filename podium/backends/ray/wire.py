"""How calls and results travel through Ray.

A value crosses as a *payload*: the tuple ``(header, buffers, refs)``, or just
``header`` (bytes) when there are neither buffers nor refs -- the common small
call, which Ray then moves as plain bytes.

- ``header`` is podium's pickle stream (:func:`podium.core.serialization.dumps`);
- ``buffers`` are its out-of-band buffers -- tensor and numpy memory -- as
  ``uint8`` numpy arrays over that memory (no copy). Ray stores numpy arrays
  out of band, so a large payload is copied once into the object store and
  read zero-copy from it, instead of going through ``torch.save``;
- ``refs`` are the Ray ``ObjectRef`` s of the podium futures found inside the
  value (a ``DataProtoFuture`` passed into a call). They travel as real
  ``ObjectRef`` s in a list, which Ray serializes itself, so Ray counts the
  receiving worker as a borrower and keeps the objects alive for it. Inside
  the header a future is only an index into ``refs``.

Object-store pages are shared with every reader of the object. :func:`decode`
copies such a buffer once into private memory, so tensors and numpy arrays the
user receives behave as ordinary writable ones (as on every other backend).
Two kinds of payload have one reader only, and skip that copy for their large
buffers:

- a call's own message (:func:`decode_own`): Ray stores each task's arguments
  as an object of that task alone (and podium's actors never retry a task), so
  a rank's DP shard is written into the store once by the controller and used
  there, writable, by the rank -- as a torchrun rank uses its shared-memory
  segment. Values several ranks receive travel apart (``shared``) and are copied;
- a result whose batch rows only a collect reads (:func:`podium.core.backend.rows_joined`):
  the collect's copy is then the only one.

A tensor over store memory keeps its object in the store while it lives.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

import numpy as np

from podium.core.serialization import dumps, loads

__all__ = ["SHARED_MIN", "Shared", "decode", "decode_own", "encode", "payload_nbytes", "shareable"]

# bytes, or (header: bytes, buffers: list[np.ndarray], refs: list[ray.ObjectRef])
Payload = Any

# Object-store buffers at least this large are left in the store for a result
# whose rows a collect copies (smaller ones are copied: it costs little).
SHARED_MIN = 1 << 20

# ObjectRefs of the futures met while pickling / the refs that arrived with a payload.
_outgoing_refs: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "podium_ray_outgoing_refs", default=None
)
_incoming_refs: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "podium_ray_incoming_refs", default=None
)


def encode(obj: Any) -> Payload:
    """``obj`` as a payload; tensor memory is referenced, not copied."""
    token = _outgoing_refs.set([])
    try:
        header, buffers = dumps(obj)
        refs = _outgoing_refs.get() or []
    finally:
        _outgoing_refs.reset(token)
    if not buffers and not refs:
        return header
    arrays = [np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers]
    return (header, arrays, refs)


def decode(payload: Payload, *, keep: Sequence[np.ndarray] = ()) -> Any:
    """The value of ``payload``, in private memory; tensors on the buffers in ``keep``
    (some of its :func:`shareable` ones) stay in the object store (the caller copies them)."""
    if isinstance(payload, bytes):
        return loads(payload)
    header, arrays, refs = payload
    kept = {id(a) for a in keep}
    # np.array: numpy allocates large blocks with transparent huge pages where the
    # kernel allows (madvise), which makes this copy ~4x faster than bytearray's.
    buffers = [a if a.flags.writeable or id(a) in kept else np.array(a) for a in arrays]
    token = _incoming_refs.set(list(refs))
    try:
        return loads(header, buffers, shared_buffers=keep)
    finally:
        _incoming_refs.reset(token)


def decode_own(payload: Payload) -> Any:
    """The value of a call's own message: what no other task reads. Its large store
    buffers are used in place; writes there reach no one else (see the module doc)."""
    return decode(payload, keep=shareable(payload))


def shareable(payload: Payload) -> list[np.ndarray]:
    """The buffers of ``payload`` large enough to leave in the store (``decode(..., keep=)``)."""
    if isinstance(payload, bytes):
        return []
    return [a for a in payload[1] if not a.flags.writeable and a.nbytes >= SHARED_MIN]


def payload_nbytes(payload: Payload) -> int:
    if payload is None:
        return 0
    if isinstance(payload, bytes):
        return len(payload)
    header, arrays, _ = payload
    return len(header) + sum(a.nbytes for a in arrays)


def stash_ref(ref: Any) -> int | None:
    """Record ``ref`` for the payload being encoded; its index, or None outside :func:`encode`."""
    refs = _outgoing_refs.get()
    if refs is None:
        return None
    refs.append(ref)
    return len(refs) - 1


def take_ref(index: int) -> Any:
    refs = _incoming_refs.get()
    if refs is None or index >= len(refs):
        raise RuntimeError(
            "a podium Ray future was unpickled outside a podium Ray payload; pass futures "
            "to workers through WorkerGroup calls"
        )
    return refs[index]


class Shared:
    """Placeholder, in a rank's arguments, for the ``index``-th value shared by several ranks."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> Any:
        return (Shared, (self.index,))
