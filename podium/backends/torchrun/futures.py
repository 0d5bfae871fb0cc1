"""A torchrun group's futures: one per rank and call, resolved by whichever thread serves the channel."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

from podium.backends.torchrun.channel import ControlChannel
from podium.core.futures import RankFuture
from podium.core.host import Outcome
from podium.errors import CallTimeoutError

__all__ = ["CallBatch", "TorchrunFuture"]

# Said of a wait that timed out on a call without a deadline of its own.
_STILL_RUNNING = (
    "the call is still running there; its futures stay valid, so get() them again to wait longer"
)


class CallBatch:
    """What the futures of one submission share: how many are pending, whether one failed."""

    __slots__ = ("call_id", "expire", "failed", "left", "size")

    def __init__(
        self, n: int, call_id: int = -1, expire: Callable[[int], None] | None = None
    ) -> None:
        self.size = n
        self.left = n
        self.failed = False
        self.call_id = call_id
        # Called when the call's deadline passes: fails the futures still
        # pending with CallTimeoutError and interrupts the call on its ranks.
        self.expire = expire

    def settled(self) -> bool:
        return self.failed or self.left <= 0


class TorchrunFuture(RankFuture):
    """One rank's pending call; resolved by whichever thread serves the channel.

    A thread that waits serves the channel itself (see :mod:`.channel`), so
    resolving needs no ``threading.Event``: a flag, set after the outcome, is
    what waiters look at.
    """

    def __init__(
        self,
        rank: int,
        method: str,
        deadline: float | None,
        timeout: float | None,
        channel: ControlChannel,
        batch: CallBatch,
    ) -> None:
        self.rank = rank  # RankFuture's two, without a call to its __init__ (one per rank and call)
        self.method = method
        self._channel = channel
        self._batch = batch
        self._done = False
        self._outcome: Outcome | None = None
        self._error: BaseException | None = None
        self._deadline = deadline
        self._timeout = timeout

    # Resolved on the thread serving the channel (which holds its lock);
    # failed from there or from shutdown. ``failed`` is set before ``left``
    # can be wrong, so a waiter never misses the end of a batch.
    def _resolve(self, outcome: Outcome) -> None:
        self._outcome = outcome
        self._done = True
        if not outcome.ok:
            self._batch.failed = True
        self._batch.left -= 1

    def _fail(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._done = True
            self._batch.failed = True
            self._batch.left -= 1

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        wait = timeout
        if self._deadline is not None:
            left = max(0.0, self._deadline - time.monotonic())
            wait = left if wait is None else min(wait, left)
        if not self._done and not self._channel.wait(self.done, wait):
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._expire()
            if not self._done:
                raise CallTimeoutError(
                    self.method, timeout or 0.0, [self.rank], detail=_STILL_RUNNING
                )
        if self._error is not None:
            raise self._error
        outcome = self._outcome
        if outcome is None:  # cannot happen: _done is set with one of the two
            raise RuntimeError(f"future of rank {self.rank} resolved without a result")
        return outcome.unwrap()

    def _expire(self) -> None:
        if self._batch.expire is not None:
            self._batch.expire(self._batch.call_id)

    @classmethod
    def gather(cls, futures: Sequence[RankFuture], timeout: float | None = None) -> list[Any]:
        # Wait for a whole submission in one go (one pass through the channel's
        # wait instead of one per rank), stopping early when any rank failed;
        # then collect results and errors in rank order. ``timeout`` bounds
        # the whole of it.
        until = None if timeout is None else time.monotonic() + timeout
        first = futures[0] if futures else None
        if (
            isinstance(first, TorchrunFuture)
            and not first._batch.settled()
            # The whole submission: as many distinct futures as it has, all of
            # its batch (checked with C loops: this runs on every call).
            and len(set(map(id, futures))) == first._batch.size
            and set(map(getattr, futures, repeat("_batch"), repeat(None))) == {first._batch}
        ):
            wait = timeout
            if first._deadline is not None:  # one submission: one deadline
                left = max(0.0, first._deadline - time.monotonic())
                wait = left if wait is None else min(wait, left)
            first._channel.wait(first._batch.settled, wait)
            batch = first._batch
            if batch.left <= 0 and not batch.failed:  # every rank answered, none failed
                return [f._outcome.value for f in futures]  # type: ignore[attr-defined]
        out = []
        for i, fut in enumerate(futures):
            remaining = None if until is None else max(0.0, until - time.monotonic())
            try:
                out.append(fut.result(remaining))
            except CallTimeoutError as exc:
                if isinstance(fut, TorchrunFuture) and exc is fut._error:
                    raise  # the call's own deadline: it names every rank it interrupted
                pending = [f.rank for f in futures[i:] if not f.done()]
                raise CallTimeoutError(
                    fut.method, timeout or 0.0, pending or [fut.rank], detail=_STILL_RUNNING
                ) from None
        return out
