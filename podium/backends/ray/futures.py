"""The Ray backend's per-rank future: one ``ObjectRef`` holding one rank's encoded outcome.

It pickles (into another group's call) and resolves wherever Ray runs -- the
controller or a worker -- so a ``DataProtoFuture`` moves data worker to worker.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError

from podium.backends.ray import wire
from podium.core.futures import RankFuture
from podium.core.host import Outcome
from podium.errors import CallTimeoutError, WorkerDiedError

__all__ = ["RayRankFuture", "died_error"]

# How often a wait on several ranks looks for a rank that already failed while
# others still run (a dead rank must not wait behind live ones blocked on it).
_POLL_S = 0.2


def died_error(
    rank: int, exc: BaseException, *, pid: int | None = None, log_tail: str = ""
) -> WorkerDiedError:
    """A Ray error that means the rank's process is gone, as podium's error."""
    text = str(exc).strip()
    # Ray's message is long; its first lines say what happened.
    detail = " ".join(line.strip() for line in text.splitlines()[:3] if line.strip())
    if isinstance(exc, ObjectLostError):
        detail = f"its result was lost with the node or process holding it ({detail})"
    if pid is not None:
        detail = f"process {pid}; {detail}"
    return WorkerDiedError(rank, detail=detail[:600], log_tail=log_tail)


class RayRankFuture(RankFuture):
    """The pending result of one rank's call, held as a Ray ``ObjectRef``."""

    def __init__(
        self,
        ref: Any,
        rank: int,
        method: str,
        *,
        deadline: float | None = None,
        timeout: float | None = None,
        on_died: Callable[[int, BaseException], WorkerDiedError] | None = None,
    ) -> None:
        super().__init__(rank, method)
        self.ref = ref
        self._deadline = deadline
        self._timeout = timeout
        # The group: it describes the death (log tail) and marks itself dead.
        # Weak, so a future does not keep a group alive.
        self._on_died = weakref.WeakMethod(on_died) if on_died is not None else None
        self._value: Any = _UNSET

    def __reduce__(self) -> Any:
        index = wire.stash_ref(self.ref)
        if index is None:  # pickled by Ray itself, which handles ObjectRefs
            return (_rebuild_direct, (self.ref, self.rank, self.method))
        return (_rebuild_from_payload, (index, self.rank, self.method))

    def done(self) -> bool:
        if self._value is not _UNSET:
            return True
        ready, _ = ray.wait([self.ref], num_returns=1, timeout=0, fetch_local=False)
        return bool(ready)

    def result(self, timeout: float | None = None) -> Any:
        return self.gather([self], timeout)[0]

    @classmethod
    def gather(cls, futures: Sequence[RankFuture], timeout: float | None = None) -> list[Any]:
        futs: list[RayRankFuture] = list(futures)  # type: ignore[arg-type]
        if not futs:
            return []
        deadline, limit = _deadline_of(futs, timeout)
        todo = [f for f in futs if f._value is _UNSET]
        if todo and not _fast_path(todo, deadline):
            _slow_path(todo, deadline, limit)
        return [f._value.unwrap() for f in futs]

    def _settle(self) -> None:
        if self._value is not _UNSET:
            return
        try:
            payload = ray.get(self.ref)
        except (RayActorError, ObjectLostError) as exc:
            callback = self._on_died() if self._on_died is not None else None
            raise (
                callback(self.rank, exc) if callback is not None else died_error(self.rank, exc)
            ) from None
        except GetTimeoutError:  # pragma: no cover - only called on ready refs
            raise CallTimeoutError(self.method, 0.0, [self.rank]) from None
        self._value = decode_outcome(payload)


_OK_NONE = Outcome(True, None)


def decode_outcome(payload: Any) -> Outcome:
    """A rank's encoded :class:`Outcome`; ``None`` is an ok call that returned nothing."""
    return _OK_NONE if payload is None else wire.decode(payload)


def _fast_path(todo: list[RayRankFuture], deadline: float | None) -> bool:
    """One ``ray.get`` for calls that finish quickly and well (the common case)."""
    left = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
    try:
        payloads = ray.get([f.ref for f in todo], timeout=left)
    except (GetTimeoutError, RayActorError, ObjectLostError):
        return False  # still running, or failed: the slow path says which rank
    for f, value in zip(todo, _decode_all(payloads)):
        f._value = value
    return True


# Copying large results out of the object store is most of what the controller
# does for a big DP call; numpy releases the GIL while copying, so several
# ranks' results are copied on several cores at once.
_PARALLEL_DECODE_BYTES = 4 * 1024 * 1024
_decoder: ThreadPoolExecutor | None = None
_decoder_lock = threading.Lock()


def _decode_all(payloads: list[Any]) -> list[Any]:
    if len(payloads) < 2 or sum(wire.payload_nbytes(p) for p in payloads) < _PARALLEL_DECODE_BYTES:
        return [decode_outcome(p) for p in payloads]
    global _decoder
    with _decoder_lock:
        if _decoder is None:
            _decoder = ThreadPoolExecutor(
                max_workers=max(1, min(4, os.cpu_count() or 1)),
                thread_name_prefix="podium-ray-decode",
            )
    return list(_decoder.map(decode_outcome, payloads))


def _slow_path(todo: list[RayRankFuture], deadline: float | None, limit: float | None) -> None:
    """Wait in short steps, settling finished ranks as they come, so a dead rank is
    reported at once even while its peers are stuck waiting for it (a collective)."""
    by_ref = {f.ref: f for f in todo}
    pending = list(by_ref)
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise CallTimeoutError(todo[0].method, limit or 0.0, [by_ref[r].rank for r in pending])
        wait_s = _POLL_S if left is None else min(_POLL_S, left)
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        for ref in ready:
            by_ref[ref]._settle()


def _deadline_of(
    futs: Sequence[RayRankFuture], timeout: float | None
) -> tuple[float | None, float | None]:
    """The earliest of the wait's own limit and the calls' deadlines, and the limit to report."""
    now = time.monotonic()
    best: tuple[float | None, float | None] = (None, None)
    if timeout is not None:
        best = (now + timeout, timeout)
    for f in futs:
        if f._deadline is not None and (best[0] is None or f._deadline < best[0]):
            best = (f._deadline, f._timeout)
    return best


class _Unset:
    pass


_UNSET: Any = _Unset()


def _rebuild_direct(ref: Any, rank: int, method: str) -> RayRankFuture:
    return RayRankFuture(ref, rank, method)


def _rebuild_from_payload(index: int, rank: int, method: str) -> RayRankFuture:
    return RayRankFuture(wire.take_ref(index), rank, method)
