"""Futures: the handle a non-blocking call returns, and :func:`get` to resolve them."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from podium.core.dataplane import RowReference
from podium.errors import CallTimeoutError

__all__ = ["DataProtoFuture", "RankFuture", "get"]


class RankFuture(ABC):
    """The pending result of one rank's call. Backends subclass it.

    Behaviours a backend's future must have:

    1. ``result(timeout)`` returns the method's return value, or raises the
       worker's exception as a :class:`podium.RemoteError`, a
       :class:`podium.errors.WorkerDiedError` when the rank died, or a
       :class:`podium.errors.CallTimeoutError` past ``timeout``.
    2. ``result`` may be called several times and returns the same value.
    3. ``gather`` waits for many futures of the same class at once; override it
       when the backend can wait on them together (``ray.get`` on a list).
    """

    def __init__(self, rank: int, method: str) -> None:
        self.rank = rank
        self.method = method

    @abstractmethod
    def result(self, timeout: float | None = None) -> Any: ...

    @abstractmethod
    def done(self) -> bool: ...

    @classmethod
    def gather(cls, futures: Sequence[RankFuture], timeout: float | None = None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for i, fut in enumerate(futures):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(fut.result(left))
            except CallTimeoutError:
                pending = [f.rank for f in futures[i:] if not f.done()]
                raise CallTimeoutError(fut.method, timeout or 0.0, pending or [fut.rank]) from None
        return out

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} method={self.method!r} done={self.done()}>"


class DataProtoFuture:
    """The pending, collected result of a DP-dispatched call.

    ``get()`` waits for every rank, collects (concatenates) their outputs and
    removes the rows that dispatch padded in. Passing it into another group's
    call either moves the data worker-to-worker (backends with
    ``worker_to_worker_futures``) or resolves it at the controller first.
    ``chunk(n)`` splits it lazily: each chunk resolves to one piece.
    """

    def __init__(
        self,
        collect_fn: Callable[[list[Any]], Any],
        futures: Sequence[RankFuture],
        dispatch_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        self.collect_fn = collect_fn
        self.futures = list(futures)
        self.dispatch_fn = dispatch_fn

    @classmethod
    def concat(cls, data: Sequence[RankFuture]) -> DataProtoFuture:
        from podium.core.protocol import DataProto

        return cls(collect_fn=DataProto.concat, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        return [
            DataProtoFuture(self.collect_fn, self.futures, _ChunkPick(i, chunks, self.dispatch_fn))
            for i in range(chunks)
        ]

    def get(self, timeout: float | None = None) -> Any:
        outputs = get(self.futures, timeout=timeout)
        result = self.collect_fn(outputs)
        if self.dispatch_fn is not None:
            result = self.dispatch_fn(result)
        return result

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def __repr__(self) -> str:
        return f"<DataProtoFuture ranks={[f.rank for f in self.futures]} done={self.done()}>"


class _ChunkPick:
    """Picklable ``lambda x: x.chunk(n)[i]`` (after an optional earlier pick)."""

    def __init__(self, index: int, chunks: int, before: Callable[[Any], Any] | None) -> None:
        self.index = index
        self.chunks = chunks
        self.before = before

    def __call__(self, data: Any) -> Any:
        if self.before is not None:
            data = self.before(data)
        return data.chunk(self.chunks)[self.index]


def get(x: Any, timeout: float | None = None) -> Any:
    """Resolve a future, a (nested) list of futures, a :class:`DataProtoFuture` or a
    :class:`podium.BatchRef` (its rows, brought to the controller).

    Anything else is returned unchanged. ``timeout`` bounds the whole wait and
    raises :class:`podium.errors.CallTimeoutError` naming the ranks that did not answer.
    """
    if isinstance(x, DataProtoFuture):
        return x.get(timeout)
    if isinstance(x, RowReference):
        return x.materialize(timeout)
    if isinstance(x, RankFuture):
        return type(x).gather([x], timeout)[0]
    if isinstance(x, (list, tuple)):
        if x and all(isinstance(f, RankFuture) for f in x) and len({type(f) for f in x}) == 1:
            return list(type(x[0]).gather(list(x), timeout))
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for item in x:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(get(item, left))
        return type(x)(out) if isinstance(x, tuple) else out
    return x
