"""How values cross a process boundary.

One pickler for every backend: cloudpickle (so classes and functions from
``__main__``, a notebook or a test file travel by value) with protocol 5, where
every CPU tensor becomes an out-of-band buffer over its own memory. A backend
gets ``(header, buffers)`` from :func:`dumps` and can send the buffers as they
are -- ZeroMQ frames, Ray object-store numpy arrays, shared memory -- without
``torch.save`` and without copying. :func:`loads` rebuilds tensors on top of the
received buffers; a read-only buffer (an immutable object-store page) is copied
once so the tensor is safe to write -- unless the decoder passes it in
``shared_buffers`` (memory it knows no other reader sees, for tensors that are
copied at once anyway).
"""

from __future__ import annotations

import contextvars
import ctypes
import io
import os
import pickle
import sys
import sysconfig
import types
from collections.abc import Mapping, Sequence
from typing import Any

import cloudpickle
import numpy as np
import torch

from podium.core.importability import worker_can_import

__all__ = ["copy_via_pickle", "dumps", "dumps_in_process", "ensure_importable_by_value", "loads"]

Buffer = Any  # anything exposing the buffer protocol (memoryview, PickleBuffer, zmq.Frame, ndarray)


# Read-only buffers that loads() may build tensors on as they are (see loads).
_kept_read_only: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "podium_kept_read_only", default=frozenset()
)


def _rebuild_tensor(data: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if isinstance(data, pickle.PickleBuffer):
        view = data.raw()
    else:
        view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if not view.readonly:
        flat = torch.frombuffer(view, dtype=torch.uint8)
    elif (kept := _kept_read_only.get()) and _address(view) in kept:
        flat = torch.frombuffer(_alias(view), dtype=torch.uint8)
    else:
        # Writing there would change what other readers see (an object in an
        # object store) or crash (a bytes object); one copy makes the tensor
        # an ordinary private one. numpy allocates large blocks on transparent
        # huge pages, which makes this copy several times faster than a
        # bytearray's.
        flat = torch.from_numpy(np.frombuffer(view, dtype=np.uint8).copy())
    return flat.view(dtype).reshape(shape)


def _tensor_reduce(t: torch.Tensor) -> Any:
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return (_rebuild_tensor, (b"", t.dtype, tuple(t.shape)))
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return (_rebuild_tensor, (pickle.PickleBuffer(raw), t.dtype, tuple(t.shape)))  # type: ignore[arg-type]


def _importable_as_is(obj: Any) -> bool:
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    target: Any = module
    for part in getattr(obj, "__qualname__", "<").split("."):
        target = getattr(target, part, None)
    return target is obj


class _Pickler(cloudpickle.CloudPickler):
    in_process = False

    def reducer_override(self, obj: Any) -> Any:
        # Plain strided tensors only: Parameters, DTensors, sparse and quantized
        # tensors keep torch's own reduction (they carry more than a buffer).
        if type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.is_quantized:
            return _tensor_reduce(obj)
        if self.in_process and isinstance(obj, (type, types.FunctionType)) and _importable_as_is(obj):
            # Same process on both ends: a reference is exact, and rebuilding a
            # by-value class here would overwrite the live class's methods.
            return NotImplemented
        return super().reducer_override(obj)


class _InProcessPickler(_Pickler):
    in_process = True


def dumps(obj: Any, *, out_of_band: bool = True) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialize ``obj``; tensor and numpy memory goes into the returned buffers.

    With ``out_of_band=False`` every buffer is copied into the header bytes.
    """
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler = _Pickler(
        stream,
        protocol=5,
        buffer_callback=buffers.append if out_of_band else None,
    )
    pickler.dump(obj)
    return stream.getvalue(), buffers


def loads(header: Buffer, buffers: Sequence[Buffer] = (), *, shared_buffers: Sequence[np.ndarray] = ()) -> Any:
    """Inverse of :func:`dumps`; tensors share memory with writable ``buffers``.

    Tensors on a read-only buffer get a copy of it, except on the read-only
    arrays in ``shared_buffers``, which they use as they are (the caller
    vouches that writing there harms nobody, or that the tensors are copied
    before anyone can write).
    """
    if not shared_buffers:
        return pickle.loads(header, buffers=buffers)
    token = _kept_read_only.set(frozenset(a.__array_interface__["data"][0] for a in shared_buffers))
    try:
        return pickle.loads(header, buffers=buffers)
    finally:
        _kept_read_only.reset(token)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def _alias(view: memoryview) -> Any:
    """A buffer over the memory of read-only ``view`` that torch takes as it is (it
    warns of a read-only one); it keeps ``view``, and so that memory, alive."""
    alias = (ctypes.c_uint8 * view.nbytes).from_address(_address(view))
    alias.owner = view  # type: ignore[attr-defined]
    return alias


def dumps_in_process(obj: Any) -> tuple[bytes, list[np.ndarray]]:
    """The first half of :func:`copy_via_pickle`: ``obj`` pickled, its buffers already copied.

    ``loads(*dumps_in_process(obj))`` is the copy; the inline backend runs the
    two halves apart, so that a failure says on which side of the "boundary" it was.
    """
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _InProcessPickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    return stream.getvalue(), [np.array(b.raw(), dtype=np.uint8) for b in buffers]


def copy_via_pickle(obj: Any) -> Any:
    """A deep copy made the way a process boundary makes it (used by the inline backend)."""
    return loads(*dumps_in_process(obj))


_INSTALLED_ROOTS = tuple(
    p
    for p in {
        sysconfig.get_paths().get("purelib"),
        sysconfig.get_paths().get("platlib"),
        sysconfig.get_paths().get("stdlib"),
        sysconfig.get_paths().get("platstdlib"),
    }
    if p
)


def ensure_importable_by_value(obj: Any, worker_env: Mapping[str, str] | None = None) -> None:
    """Make user code that workers cannot import travel by value.

    Classes from ``__main__`` already do (cloudpickle's rule). Code from a test
    file or a script's sibling module is importable in the controller only
    because of how the controller was started (pytest's rootdir, the script's
    directory on ``sys.path``); a worker started elsewhere cannot import it, so
    its module is registered with cloudpickle to be pickled by value. Modules a
    worker can import -- installed, editable installs, directories on
    ``PYTHONPATH`` (the controller's, or the one ``worker_env`` sets) -- go by
    reference, so a class stays itself (see :mod:`podium.core.importability`).
    """
    module_name = getattr(obj, "__module__", None)
    if not module_name or module_name == "__main__":
        return
    top = module_name.split(".")[0]
    if top in ("podium", "builtins", "torch", "numpy") or top in sys.stdlib_module_names:
        return
    module = sys.modules.get(module_name)
    if not isinstance(module, types.ModuleType):
        return
    path = getattr(module, "__file__", None)
    if not path or path.startswith(_INSTALLED_ROOTS):
        return
    env = os.environ if worker_env is None or "PYTHONPATH" not in worker_env else worker_env
    if worker_can_import(module, env.get("PYTHONPATH")):
        return
    try:
        cloudpickle.register_pickle_by_value(module)
    except ValueError:
        pass  # already registered, or a module cloudpickle cannot register

