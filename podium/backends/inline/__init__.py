"""The inline backend: every rank is an object in the controller process.

No processes, no process group, no per-rank environment; breakpoints work.
For debugging and fast unit tests. Each rank receives its own copy of every
argument, and the controller a copy of every result, made by pickling as a
process boundary would, so code behaves here as it does on process backends.

A call runs when it is submitted, in the submitting thread, if its rank is
idle; otherwise it is queued and ``submit`` returns at once. The backend
contract holds as on process backends:

1. One call per rank at a time, in submission order: a queued call runs in the
   thread that frees the rank, or in the thread that waits for its result,
   whichever comes first (a worker method that calls its own rank again from
   the same thread runs at once, where a process backend would deadlock).
   An ``async def`` call starts in that order too, then waits for its
   coroutine (on the rank's event loop) in a thread of its own, so the rank
   goes on to its next calls (``Capabilities.concurrent_async_calls``).
2. ``sys.exit()`` (``SystemExit``) in a worker method is that rank's death:
   :class:`podium.errors.WorkerDiedError`, and the group is unusable, as when a
   worker process exits. ``os._exit()`` cannot be caught in-process: it ends
   the controller, since every rank *is* the controller.
3. ``shutdown()`` does not wait on calls in flight: they raise
   :class:`podium.errors.GroupShutdownError` as soon as the rank method that is
   running returns (it cannot be interrupted in-process), and calls waiting for
   a rank raise it without running.
4. Each rank's ``Worker.shutdown()`` hook runs once, on ``shutdown()``, when the
   group is dropped without one (garbage collected), or at interpreter exit --
   never while a call runs on that rank. A failing hook is logged.
5. A ``use_gpu=True`` pool starts only when the controller sees a GPU; its
   ranks then share the controller's devices (none is given its own).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from podium.backend_api import rank_infos
from podium.core import dataplane
from podium.core.backend import Backend, BackendGroup, Capabilities, GroupSpec, RankCall
from podium.core.futures import RankFuture
from podium.core.host import (
    ARGUMENT_NOT_LOADED,
    RESULT_NOT_LOADED,
    RESULT_NOT_SENT,
    Outcome,
    WorkerHost,
    crossing_failure,
    is_async_target,
    max_async_calls,
)
from podium.core.resource import ResourcePool
from podium.core.serialization import copy_via_pickle, dumps_in_process, loads
from podium.errors import (
    GroupShutdownError,
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerStartupError,
)

__all__ = ["InlineBackend", "InlineHandles"]

log = logging.getLogger("podium.inline")


class InlineFuture(RankFuture):
    """One rank's call: queued on its rank, run by whichever thread holds the rank next."""

    def __init__(self, rank: int, method: str, group: InlineGroup, payload: Any) -> None:
        super().__init__(rank, method)
        self._group: InlineGroup | None = group
        self._payload = payload
        self._outcome: Outcome | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._handed_off = False  # an async call: its rank moved on; it finishes in its own thread

    def _finish(self, outcome: Outcome | None, error: BaseException | None) -> None:
        self._outcome, self._error = outcome, error
        self._group = self._payload = None  # a kept future holds no group
        self._done.set()

    def result(self, timeout: float | None = None) -> Any:
        while not self._done.is_set():
            group = self._group
            if self._handed_off or group is None:
                self._done.wait()  # an async call, running in a thread of its own
            else:
                group._drain(self.rank, blocking=True)  # run what is queued before it, then it
        if self._error is not None:
            raise self._error
        if self._outcome is None:  # cannot happen: one of the two is always set
            raise RuntimeError(f"inline future of rank {self.rank} has no result")
        return self._outcome.unwrap()

    def done(self) -> bool:
        return self._done.is_set()


class _Rank:
    """One rank: its host, its queue of calls, and the lock that runs them one at a time."""

    __slots__ = ("async_pool", "closing", "host", "lock", "queue", "users")

    def __init__(self, host: WorkerHost) -> None:
        self.host: WorkerHost | None = host
        self.async_pool: ThreadPoolExecutor | None = None  # runs its async calls, made at the first
        self.lock = threading.RLock()
        self.queue: deque[InlineFuture] = deque()
        self.users = 0  # threads inside ``lock`` (guarded by the group's state lock)
        self.closing = False  # the hook was handed to someone to run


class _State:
    """What a group and its finalizer share (the finalizer must not hold the group)."""

    def __init__(self, name: str, env: dict[str, str | None]) -> None:
        self.name = name
        self.env = env
        self.ranks: list[_Rank] = []
        self.guard = threading.Lock()
        self.closed = False
        self.dead: WorkerDiedError | None = None


def _close_rank(state: _State, rank: _Rank) -> None:
    if rank.async_pool is not None:
        rank.async_pool.shutdown(wait=False)
    host, rank.host = rank.host, None
    if host is None:
        return
    failure = host.close()
    if failure is not None:
        log.warning("group %r: the shutdown() hook failed: %s", state.name, failure.to_exception())


def _close(state: _State) -> None:
    """Shut the group down without waiting on calls (the finalizer of every :class:`InlineGroup`)."""
    with state.guard:
        state.closed = True
        idle = [rank for rank in state.ranks if rank.users == 0 and not rank.closing]
        for rank in idle:
            rank.closing = True
    # A busy rank is closed by the thread running its call, once it returns.
    for rank in idle:
        _close_rank(state, rank)
    env, state.env = state.env, {}
    for key, old in env.items():
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@dataclass(frozen=True)
class InlineHandles:
    """``WorkerGroup.backend_handles`` on the inline backend."""

    workers: list[Any]
    """Each rank's worker object, in rank order (a colocated group's: the fused worker).
    Calling them directly bypasses the rank's one-call-at-a-time order."""


class InlineGroup(BackendGroup):
    def __init__(self, spec: GroupSpec) -> None:
        pool = spec.pool
        self.world_size = pool.world_size
        self.worker_names = [f"{spec.name_prefix}_{rank}" for rank in range(self.world_size)]
        self._cls_with_init = spec.cls_with_init
        self._async_targets: dict[str, bool] = {}
        self._max_async = max_async_calls(spec.cls_with_init.cls)
        self._state = state = _State(spec.name_prefix, _apply_env(spec.worker_env))
        self._finalizer = weakref.finalize(self, _close, state)
        for rank, info in enumerate(rank_infos(pool)):
            try:
                host, outcome = WorkerHost.start(info, copy_via_pickle(spec.cls_with_init))
            except SystemExit as exc:
                self._finalizer()
                raise WorkerStartupError(
                    f"the constructor of rank {rank} called sys.exit({exc.code!r})", rank=rank
                ) from None
            if host is None:
                self._finalizer()
                outcome.unwrap()
                return
            state.ranks.append(_Rank(host))

    def submit(
        self, target: str, calls: Sequence[RankCall], *, timeout: float | None = None
    ) -> list[RankFuture]:
        # Every argument is pickled first, as a process backend does before
        # sending: one that does not pickle raises here and no rank runs.
        sent = [dumps_in_process((call.args, call.kwargs)) for call in calls]
        futures = [InlineFuture(call.rank, target, self, payload) for call, payload in zip(calls, sent)]
        for future in futures:
            self._state.ranks[future.rank].queue.append(future)
        for rank in dict.fromkeys(call.rank for call in calls):
            self._drain(rank, blocking=False)  # an idle rank runs now; a busy one later
        return list(futures)

    def _drain(self, index: int, *, blocking: bool) -> None:
        """Run the rank's queued calls in order, if this thread gets the rank (or waits for it)."""
        rank = self._state.ranks[index]
        while rank.lock.acquire(blocking=blocking):
            try:
                while rank.queue:
                    self._run(rank, index, rank.queue.popleft())
            finally:
                rank.lock.release()
            # A call queued while this thread ran, by a thread that found the rank
            # busy, is this thread's to run: look again after releasing.
            if not rank.queue:
                return
            blocking = False

    def _run(self, rank: _Rank, index: int, future: InlineFuture) -> None:
        state = self._state
        target, payload = future.method, future._payload
        with state.guard:
            rank.users += 1
            stopped = state.closed
        if not stopped and state.dead is None and self._is_async(target):
            # An async call waits for its coroutine in a thread of its own (the
            # coroutine runs on the rank's loop): the rank goes on to its next call.
            with state.guard:
                if rank.async_pool is None:
                    rank.async_pool = ThreadPoolExecutor(
                        max_workers=self._max_async, thread_name_prefix=f"podium-inline-{index}-async"
                    )
                pool = rank.async_pool
            future._handed_off = True
            pool.submit(self._finish, rank, index, future, target, payload, stopped)
            return
        self._finish(rank, index, future, target, payload, stopped)

    def _is_async(self, target: str) -> bool:
        found = self._async_targets.get(target)
        if found is None:
            found = self._async_targets[target] = is_async_target(self._cls_with_init, target)
        return found

    def _finish(
        self, rank: _Rank, index: int, future: InlineFuture, target: str, payload: Any, stopped: bool
    ) -> None:
        state = self._state
        error: BaseException | None = None
        outcome: Outcome | None = None
        try:
            if stopped:
                error = GroupShutdownError(state.name, method=target, ranks=[index])
            elif state.dead is not None:
                error = state.dead
            else:
                outcome = self._call(rank, index, target, payload)
                if outcome is None:
                    error = state.dead
        finally:
            with state.guard:
                rank.users -= 1
                close_now = state.closed and rank.users == 0 and not rank.closing
                if close_now:
                    rank.closing = True
                if state.closed and error is None:
                    # Shut down while this call ran: its result is not delivered.
                    error = GroupShutdownError(state.name, method=target, ranks=[index])
            if close_now:
                _close_rank(state, rank)
            future._finish(outcome if error is None else None, error)

    def _call(
        self, rank: _Rank, index: int, target: str, payload: tuple[bytes, list[np.ndarray]]
    ) -> Outcome | None:
        """One call on one rank; ``None`` when the call ended the rank (``sys.exit``)."""
        host = rank.host
        if host is None:  # cannot happen: a rank loses its host only when closed or dead
            raise RuntimeError(f"rank {index} of group {self._state.name!r} has no worker")
        try:
            args, kwargs = loads(*payload)
        except Exception as exc:
            return crossing_failure(exc, index, target, ARGUMENT_NOT_LOADED)
        try:
            outcome = host.run(target, args, kwargs)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            rank.host = None  # the worker is gone, as with a process that exited: no hook
            self._state.dead = WorkerDiedError(
                index,
                exit_code=code,
                detail=(
                    f"{target!r} called sys.exit({exc.code!r}); the inline backend runs every rank in the "
                    "controller process, so it ends the rank instead of the controller"
                ),
            )
            return None
        if not outcome.ok:
            return outcome
        try:
            result = dumps_in_process(outcome.value)
        except Exception as exc:
            return crossing_failure(exc, index, target, RESULT_NOT_SENT)
        try:
            return Outcome(True, loads(*result))
        except Exception as exc:
            return crossing_failure(exc, index, target, RESULT_NOT_LOADED)

    def handles(self) -> InlineHandles:
        return InlineHandles([r.host.worker if r.host is not None else None for r in self._state.ranks])

    def _shutdown(self) -> None:
        self._finalizer()


def _apply_env(worker_env: dict[str, str] | Any) -> dict[str, str | None]:
    """Inline ranks share the controller's environment: worker_env is set there for the group's life."""
    saved: dict[str, str | None] = {}
    for key, value in worker_env.items():
        current = os.environ.get(key)
        if current is not None and current != value:
            raise ValueError(
                f"worker_env sets {key}={value!r}, but the controller (which the inline backend runs "
                f"every rank in) already has {key}={current!r}"
            )
        saved[key] = current
        os.environ[key] = value
    return saved


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class InlineBackend(Backend):
    name = "inline"
    capabilities = Capabilities(
        fractional_colocation=True, batch_refs=True, concurrent_async_calls=True
    )
    options = ()

    def check_resources(self, pools: Sequence[ResourcePool]) -> None:
        """A ``use_gpu=True`` pool needs a GPU in the controller (its ranks share it)."""
        wanted = [pool for pool in pools if pool.use_gpu]
        if wanted and _visible_gpus() == 0:
            demand = sum(pool.world_size for pool in wanted)
            raise ResourceUnavailableError(
                f"a use_gpu=True pool ({demand} rank(s)) cannot start on the inline backend: it runs "
                "every rank in the controller process, which sees no GPU. Make the pool with "
                "use_gpu=False, or use a backend with GPUs ('ray', 'torchrun').",
                demand={"GPU": demand},
                supply={"GPU": 0},
            )

    def _start_group(self, spec: GroupSpec) -> BackendGroup:
        group = InlineGroup(spec)
        if self.capabilities.batch_refs:
            # Ranks live in this process: an exported shard stays the object it is.
            for rank in group._state.ranks:
                if rank.host is not None:
                    rank.host.shards.exporter = dataplane.InlineExporter()
        return group
