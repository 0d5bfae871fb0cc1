"""Batch operations: what dispatch needs to know about a data argument.

Dispatch splits *batches* over ranks and joins the ranks' results back. A
batch is any object whose type is registered here; everything else goes whole
to every rank. podium registers :class:`podium.DataProto`, ``TensorDict`` and
:class:`podium.DataProtoFuture`; a library with its own batch type (a metadata
handle to data held elsewhere, a key-value batch) registers it once::

    from podium.batching import register_batch_type

    register_batch_type(
        MyBatch,
        length=lambda b: b.num_rows,
        chunk=lambda b, n: b.split_evenly(n),
        concat=MyBatch.concat,
        pad=lambda b, divisor: b.pad_to(divisor),      # optional
        unpad=lambda b, rows: b[: len(b) - rows],        # optional
    )

Each operation is a :func:`functools.singledispatch` function, so subclasses
inherit their base's entry and a more specific registration wins. The rules
every implementation follows (dispatch relies on them):

- ``length(batch)`` is the number of rows, or ``None`` when it is not known
  yet (a future); a batch of unknown length is never padded at the controller.
- ``chunk(batch, n)`` returns ``n`` batches of equal length, in row order; it
  is only called with a length that divides by ``n``.
- ``split(batch, sizes)`` returns consecutive pieces of the given sizes (the
  default slices ``batch[a:b]``).
- ``concat(parts)`` joins pieces of one type back in order.
- ``pad(batch, divisor)`` returns a *new* batch whose length divides by
  ``divisor``, repeating rows from the start (never changes ``batch``);
  ``unpad(batch, rows)`` drops the last ``rows`` rows. A type without them
  cannot be padded: a batch that does not divide is then an error.
- A batch whose ``is_padding_enabled()`` (or, without that method, whose
  ``auto_padding`` attribute) is true may be padded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from podium.core.futures import DataProtoFuture
from podium.core.protocol import DataProto, cat_batches, pad_dataproto_to_divisor, unpad_dataproto

__all__ = [
    "NotABatchError",
    "auto_padding",
    "can_pad",
    "chunk",
    "concat",
    "is_batch",
    "length",
    "pad",
    "register_batch_type",
    "split",
    "unpad",
]


class NotABatchError(TypeError):
    """An operation was asked of a value whose type is not registered as a batch."""


def length(batch: Any) -> int | None:
    """Rows in ``batch``; ``None`` when not known yet."""
    return _length(batch)


def chunk(batch: Any, chunks: int) -> list[Any]:
    """``chunks`` equal pieces of ``batch``, in row order."""
    return _chunk(batch, chunks)


def split(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Consecutive pieces of ``batch`` with the given sizes."""
    return _split(batch, list(sizes))


def concat(parts: Sequence[Any]) -> Any:
    """``parts`` joined in order when they are batches of one registered type; else ``list(parts)``."""
    if not parts:
        return []
    impl = _concat.dispatch(type(parts[0]))
    if impl is _concat.dispatch(object) or any(
        _concat.dispatch(type(p)) is not impl for p in parts
    ):
        return list(parts)
    return impl(parts[0], list(parts))


def pad(batch: Any, divisor: int) -> Any:
    """A new batch whose length divides by ``divisor``, rows repeated from the start."""
    n = length(batch)
    if n is None or n % divisor == 0:
        return batch
    return _pad(batch, divisor)


def unpad(batch: Any, rows: int) -> Any:
    """``batch`` without its last ``rows`` rows; a result of another type comes back as it is."""
    if rows <= 0:
        return batch
    return _unpad(batch, rows)


def auto_padding(batch: Any) -> bool:
    """Whether ``batch`` allows dispatch to pad it: its ``is_padding_enabled()`` when it has
    one (a ``DataProto``: its flag or the global ``DataProtoConfig.auto_padding``), else its
    ``auto_padding`` attribute."""
    enabled = getattr(batch, "is_padding_enabled", None)
    if callable(enabled):
        return bool(enabled())
    return bool(getattr(batch, "auto_padding", False))


def is_batch(value: Any) -> bool:
    """Whether dispatch splits ``value`` (its type, or a base, is registered)."""
    return _length.dispatch(type(value)) is not _length.dispatch(object)


def can_pad(batch: Any) -> bool:
    """Whether ``batch``'s type registered ``pad=`` and ``unpad=``."""
    return _pad.dispatch(type(batch)) is not _pad.dispatch(object)


def register_batch_type(
    cls: type,
    *,
    length: Callable[[Any], int | None],
    chunk: Callable[[Any, int], list[Any]],
    concat: Callable[[list[Any]], Any],
    split: Callable[[Any, list[int]], list[Any]] | None = None,
    pad: Callable[[Any, int], Any] | None = None,
    unpad: Callable[[Any, int], Any] | None = None,
) -> None:
    """Make dispatch split ``cls`` arguments and join ``cls`` results (see the module rules).

    Registering a type again replaces its operations. Register it in the
    controller before the first call that passes such a batch (workers see only
    their shards).
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_batch_type needs a class, got {cls!r}")
    for name, fn in (("length", length), ("chunk", chunk), ("concat", concat)):
        if not callable(fn):
            raise TypeError(
                f"register_batch_type({cls.__qualname__}): {name}= must be callable, got {fn!r}"
            )
    if (pad is None) != (unpad is None):
        raise ValueError(
            f"register_batch_type({cls.__qualname__}): give both pad= and unpad= or neither "
            "(padded rows must be removable from the result)"
        )
    _length.register(cls, length)
    _chunk.register(cls, chunk)
    _concat.register(cls, lambda first, parts: concat(parts))
    if split is not None:
        _split.register(cls, split)
    if pad is not None and unpad is not None:
        _pad.register(cls, pad)
        _unpad.register(cls, unpad)


def _unregistered(batch: Any, op: str) -> str:
    return (
        f"{type(batch).__qualname__} is not a batch type dispatch knows ({op}); register it with "
        "podium.batching.register_batch_type()"
    )


@functools.singledispatch
def _length(batch: Any) -> int | None:
    raise NotABatchError(_unregistered(batch, "length"))


@functools.singledispatch
def _chunk(batch: Any, chunks: int) -> list[Any]:
    raise NotABatchError(_unregistered(batch, "chunk"))


@functools.singledispatch
def _split(batch: Any, sizes: list[int]) -> list[Any]:
    out, start = [], 0
    for size in sizes:
        out.append(batch[start : start + size])
        start += size
    return out


@functools.singledispatch
def _concat(first: Any, parts: list[Any]) -> Any:
    return list(parts)


@functools.singledispatch
def _pad(batch: Any, divisor: int) -> Any:
    raise TypeError(
        f"{type(batch).__qualname__} batches cannot be padded; register pad= and unpad= for it "
        "with podium.batching.register_batch_type(), or make the batch divide by the DP size"
    )


@functools.singledispatch
def _unpad(batch: Any, rows: int) -> Any:
    return batch


# -- the batch types podium ships --------------------------------------------------


def _td_length(td: TensorDictBase) -> int:
    return int(td.batch_size[0]) if td.batch_dims else 0


def _td_pad(td: TensorDictBase, divisor: int) -> TensorDictBase:
    n = _td_length(td)
    rows = -n % divisor
    if rows == 0:
        return td
    out: TensorDictBase = torch.cat([td, td[torch.arange(rows) % n]], dim=0)  # type: ignore[assignment]
    return out


def _td_concat(parts: list[Any]) -> Any:
    if all(isinstance(p, TensorDict) for p in parts):
        return cat_batches(parts)
    return torch.cat(parts, dim=0)


register_batch_type(
    DataProto,
    length=len,
    chunk=lambda b, n: list(b.chunk(n)),
    concat=DataProto.concat,
    pad=lambda b, divisor: pad_dataproto_to_divisor(b, divisor)[0],
    unpad=unpad_dataproto,
)
register_batch_type(
    TensorDictBase,
    length=_td_length,
    chunk=lambda td, n: list(td.split(_td_length(td) // n, dim=0)),
    concat=_td_concat,
    pad=_td_pad,
    unpad=lambda td, rows: td[: _td_length(td) - rows] if rows > 0 else td,
)
# A future's length is known only once it resolves; dispatch splits it lazily
# and pads its shards in the worker (see podium.core.dispatch).
register_batch_type(
    DataProtoFuture,
    length=lambda fut: None,
    chunk=lambda fut, n: fut.chunk(n),
    concat=lambda parts: list(parts),
)
