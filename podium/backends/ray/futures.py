"""The Ray backend's per-rank future: one ``ObjectRef`` holding one rank's encoded outcome.

It pickles (into another group's call) and resolves wherever Ray runs -- the
controller or a worker -- so a ``DataProtoFuture`` moves data worker to worker.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, TaskCancelledError

from podium.backends.ray import wire
from podium.core.backend import rows_joined
from podium.core.dispatch import PaddedResult
from podium.core.futures import RankFuture
from podium.core.host import Outcome, RemoteFailure
from podium.core.protocol import DataProto, leaves
from podium.errors import CallTimeoutError, GroupShutdownError, PodiumError, WorkerDiedError

if TYPE_CHECKING:
    from podium.backends.ray.group import RayGroup

__all__ = ["RayRankFuture", "died_error"]

# A wait blocks in ray.get, which raises as soon as any awaited call fails (a
# dead rank is reported at once, even while its peers are stuck waiting for
# it). Ray cannot wake that wait when another thread shuts the group down, so
# a wait on a group's calls returns every _SHUTDOWN_CHECK_S to look.
_SHUTDOWN_CHECK_S = 0.5
# Ray's errors that mean the call's process or result is gone (or Ray dropped it).
_LOST = (RayActorError, ObjectLostError, TaskCancelledError)

# What a timed-out call leaves behind on Ray (said in its CallTimeoutError).
_CANCEL_NOTE = (
    "podium cancelled the call (ray.cancel): ranks where it had not started yet never run it; "
    "on ranks where it is already running Ray cannot interrupt it (an actor runs one call at a "
    "time), so it runs to its end there, its result is discarded, and that rank's next call "
    "waits for it. A long method can return early when "
    "ray.get_runtime_context().is_canceled() becomes True. Ranks that may still run it: {ranks}."
)


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
        group: RayGroup | None = None,
    ) -> None:
        super().__init__(rank, method)
        self.ref = ref
        self._deadline = deadline
        self._timeout = timeout
        # The group says whether it was shut down and describes a death (log tail).
        # Weak, so a future does not keep a group alive.
        self._group = weakref.ref(group) if group is not None else None
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

    def cancel(self, error: PodiumError | None = None) -> None:
        """Ask Ray to drop the call (see ``_CANCEL_NOTE``); later waits raise ``error``."""
        if self._value is not _UNSET:
            return
        if error is not None:
            self._value = _Failed(error)
        try:
            ray.cancel(self.ref, recursive=False)
        except Exception:  # already finished, or Ray is going away
            pass

    @classmethod
    def gather(cls, futures: Sequence[RankFuture], timeout: float | None = None) -> list[Any]:
        futs: list[RayRankFuture] = list(futures)  # type: ignore[arg-type]
        if not futs:
            return []
        deadline, limit = _deadline_of(futs, timeout)
        todo = [f for f in futs if f._value is _UNSET]
        if todo:
            _wait(todo, deadline, limit)
        return [f._value.unwrap() for f in futs]

    def _closed_group(self) -> RayGroup | None:
        group = self._group() if self._group is not None else None
        return group if group is not None and group.closed else None

    def _settle(self) -> None:
        if self._value is not _UNSET:
            return
        try:
            payload = ray.get(self.ref)
        except _LOST as exc:
            group = self._group() if self._group is not None else None
            if group is not None:
                raise group.lost(self.rank, self.method, exc) from None
            raise died_error(self.rank, exc) from None
        except GetTimeoutError:  # pragma: no cover - only called on ready refs
            raise CallTimeoutError(self.method, 0.0, [self.rank]) from None
        self._value = _decode_result(payload, self.rank, self.method)


class _Failed:
    """A settled future whose wait raises ``error`` (a timed-out, cancelled call)."""

    def __init__(self, error: PodiumError) -> None:
        self.error = error

    def unwrap(self) -> Any:
        raise copy.copy(self.error)


_OK_NONE = Outcome(True, None)


def decode_outcome(payload: Any) -> Outcome:
    """A rank's encoded :class:`Outcome`; ``None`` is an ok call that returned nothing."""
    return _OK_NONE if payload is None else wire.decode(payload)


# Copying large results out of the object store is most of what the controller
# does for a big DP call; numpy releases the GIL while copying, so several
# ranks' results are copied on several cores at once.
_PARALLEL_DECODE_BYTES = 4 * 1024 * 1024
_decoder: ThreadPoolExecutor | None = None
_decoder_lock = threading.Lock()


def _decode_result(payload: Any, rank: int, method: str, joined: bool = False) -> Outcome:
    """A rank's outcome; a return value that fails to unpickle here fails the call, with its
    rank and method, as it would have in the worker (the group stays usable).

    ``joined``: only a row-wise join reads the result (see ``rows_joined``);
    its batch tensors may stay in the object store, for the join to copy once.
    """
    try:
        if joined and payload is not None:
            shared = wire.shareable(payload)
            if shared:
                outcome = wire.decode(payload, keep=shared)
                if _only_under_rows(outcome, shared):
                    return outcome
                # Something other than the batch rows sits on that memory: copy it all.
        return decode_outcome(payload)
    except Exception as exc:
        failure = RemoteFailure.capture(exc, rank, method)
        failure.traceback += (
            f"podium: the return value could not be unpickled at the controller "
            f"(rank {rank}, method {method!r})\n"
        )
        return Outcome(False, failure)


def _only_under_rows(outcome: Outcome, shared: list[Any]) -> bool:
    """Whether the object-store buffers ``shared`` lie only under the batch tensors of a
    ``DataProto`` result -- which the collect copies, so nothing else can read or write them."""
    value = outcome.value
    if isinstance(value, PaddedResult):
        value = value.value
    if not outcome.ok or type(value) is not DataProto or value.batch is None:
        return False
    addresses = {int(a.__array_interface__["data"][0]) for a in shared}
    under_rows = {
        t.untyped_storage().data_ptr() for t in leaves(value.batch).values() if type(t) is torch.Tensor
    }
    return addresses <= under_rows and not _tensor_on(value.meta_info, addresses)


def _tensor_on(obj: Any, addresses: set[int], depth: int = 0) -> bool:
    """Whether ``obj`` (through dicts, lists and tuples) holds a tensor on one of ``addresses``
    (a batch tensor that ``meta_info`` names too, which the collect would pass on)."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().data_ptr() in addresses
    if depth > 8:
        return False
    if isinstance(obj, dict):
        return any(_tensor_on(v, addresses, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_tensor_on(v, addresses, depth + 1) for v in obj)
    return False


def _decode_all(futures: list[RayRankFuture], payloads: list[Any]) -> list[Outcome]:
    joined = rows_joined()  # read here: the decoder's threads do not see this context
    args = [(p, f.rank, f.method, joined) for f, p in zip(futures, payloads)]
    if len(payloads) < 2 or sum(wire.payload_nbytes(p) for p in payloads) < _PARALLEL_DECODE_BYTES:
        return [_decode_result(*a) for a in args]
    global _decoder
    with _decoder_lock:
        if _decoder is None:
            _decoder = ThreadPoolExecutor(
                max_workers=max(1, min(4, os.cpu_count() or 1)),
                thread_name_prefix="podium-ray-decode",
            )
    return list(_decoder.map(lambda a: _decode_result(*a), args))


def _wait(todo: list[RayRankFuture], deadline: float | None, limit: float | None) -> None:
    """Settle ``todo``: one ``ray.get`` for calls that finish well (the common case).

    ``ray.get`` raises as soon as any call's object is an error, so a rank that
    died is reported at once; the ranks that finished are settled then, and
    the first failure raises. Past the deadline the calls are cancelled.
    """
    pending = todo
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise _timed_out(pending, limit or 0.0)
        for f in pending:
            group = f._closed_group()
            if group is not None:
                ranks = sorted({p.rank for p in pending if p._closed_group() is group})
                raise GroupShutdownError(group.name, method=f.method, ranks=ranks)
        has_group = any(f._group is not None for f in pending)
        wait_s = left
        if has_group:
            wait_s = _SHUTDOWN_CHECK_S if left is None else min(_SHUTDOWN_CHECK_S, left)
        try:
            payloads = ray.get([f.ref for f in pending], timeout=wait_s)
        except GetTimeoutError:
            _raise_if_a_rank_died(pending)
            continue
        except _LOST:
            refs = [f.ref for f in pending]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            if not ready:  # the failed object is not visible to wait yet
                ready, _ = ray.wait(refs, num_returns=1, timeout=wait_s, fetch_local=False)
            done = set(ready)
            for f in pending:
                if f.ref in done:
                    f._settle()  # the failed one raises
            pending = [f for f in pending if f._value is _UNSET]
            continue
        for f, value in zip(pending, _decode_all(pending, payloads)):
            f._value = value
        return


def _raise_if_a_rank_died(pending: list[RayRankFuture]) -> None:
    """Raise the group's WorkerDiedError when any rank of a waited-on group died.

    A rank's death fails every pending call of its group, not only its own: a
    wait on rank 0 must not outlast a peer that died (rank 0 may be blocked in a
    collective with it). The group's other calls in flight show a death first.
    """
    groups = {id(g): g for f in pending if f._group is not None and (g := f._group()) is not None}
    for group in groups.values():
        if group._dead is None:
            others = [f for f in list(group._inflight) if f._value is _UNSET and f not in pending]
            if others:
                refs = [f.ref for f in others]
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
                done = set(ready)
                for f in others:
                    if f.ref in done:
                        try:
                            f._settle()
                        except PodiumError:
                            pass  # recorded on the group when it was a death
        if group._dead is not None:
            raise copy.copy(group._dead)


def _timed_out(pending: list[RayRankFuture], limit: float) -> CallTimeoutError:
    """The error for calls still pending at the deadline; calls past their own deadline are cancelled."""
    ranks = sorted({f.rank for f in pending})
    error = CallTimeoutError(pending[0].method, limit, ranks)
    now = time.monotonic()
    expired = [f for f in pending if f._deadline is not None and f._deadline <= now]
    if expired:
        error.args = (f"{error} " + _CANCEL_NOTE.format(ranks=sorted({f.rank for f in expired})),)
        for f in expired:
            f.cancel(error)
    return error


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
