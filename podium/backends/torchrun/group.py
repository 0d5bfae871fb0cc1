"""One running group of torchrun-launched workers, as the controller sees it.

The group owns its :class:`~podium.backends.torchrun.channel.ControlChannel`
and the torchx app. Everything the workers send arrives on whichever thread
serves the channel -- a caller waiting for results, or the channel's I/O
thread when no caller is active -- in :meth:`TorchrunGroup._on_message`,
which resolves futures, prints forwarded output with a rank prefix, and turns
a supervisor's exit report, a stopped worker or a missed heartbeat into
:class:`~podium.errors.WorkerDiedError` for every pending and later call.

Failures name their root cause: a rank that torchrun stopped because another
one ended first is not blamed for it (see :meth:`TorchrunGroup._blame`), and
heartbeats missed while this process itself was paused (``SIGSTOP``, a long
call holding the GIL) are forgiven. A call past its deadline fails with
:class:`~podium.errors.CallTimeoutError` and is interrupted on its ranks; calls
pending when the group shuts down fail at once with
:class:`~podium.errors.GroupShutdownError`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from podium.backends.torchrun import wire
from podium.backends.torchrun.channel import ControlChannel
from podium.backends.torchrun.dataplane import NETWORK_ENV
from podium.backends.torchrun.futures import CallBatch, TorchrunFuture
from podium.backends.torchrun.mappings import join_rows, shared_reads
from podium.backends.torchrun.shm import (
    SegmentMap,
    SegmentPool,
    shm_available,
    shm_keep,
    unlink_prefix,
)
from podium.core.backend import BackendGroup, GroupSpec, RankCall
from podium.core.futures import RankFuture
from podium.core.host import RESULT_NOT_LOADED, RETURNED_NONE, Outcome, crossing_failure
from podium.core.protocol import register_row_joiner
from podium.errors import CallTimeoutError, GroupShutdownError, WorkerDiedError, WorkerStartupError

__all__ = ["TorchrunFuture", "TorchrunGroup", "TorchrunHandles"]

log = logging.getLogger("podium.torchrun")
_TORCH_THP_ENV = "THP_MEM_ALLOC_ENABLE"

_TAIL_LINES = 40
# A tick this late means this process was paused (SIGSTOP, a long call holding
# the GIL): heartbeats missed meanwhile are not the workers' fault.
_PAUSED_AFTER = 1.0
# How long a rank that torchrun stopped waits for the report of what made it
# do so (another rank's exit or a silent supervisor) before it is blamed itself.
_ROOT_CAUSE_WAIT = 1.5
# Grace for a worker's shutdown() hook and interpreter exit when the group stops.
SHUTDOWN_GRACE = 10.0


@dataclass
class _Rank:
    rank: int
    identity: bytes = b""  # its worker's ZeroMQ identity
    pid: int | None = None
    host: str | None = None
    shm: bool = False
    connected: bool = False
    exited: bool = False  # its supervisor reported how the worker ended
    last_beat: float = 0.0
    pending: dict[int, TorchrunFuture] = field(default_factory=dict)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    partial: dict[bytes, bytes] = field(default_factory=dict)
    freed: list[str] = field(default_factory=list)  # worker segments the controller is done with
    ready: Outcome | None = None


@dataclass(frozen=True)
class TorchrunHandles:
    """``WorkerGroup.backend_handles`` on torchrun: where each rank's process runs, in rank order."""

    pids: list[int | None]
    """Each rank's worker process id, on its host (``None`` before it connected)."""
    hosts: list[str | None]
    """The host name each rank runs on."""
    control_address: str
    """The controller's ZeroMQ endpoint the ranks connect to (CURVE-secured)."""
    app_handle: str | None
    """torchx's handle of the job (``scheduler://session/app_id``), for torchx's own tools."""


class TorchrunGroup(BackendGroup):
    """The controller's handle on one torchx app of podium workers."""

    def __init__(self, spec: GroupSpec, config: dict[str, Any]) -> None:
        self.spec = spec
        self.config = config
        self.world_size = spec.pool.world_size
        self.worker_names = [f"{spec.name_prefix}:{r}" for r in range(self.world_size)]
        self.gid = secrets.token_hex(4)
        self._ranks = [_Rank(r, b"w%d" % r) for r in range(self.world_size)]
        # ZeroMQ identities of each rank's worker (w<rank>) and supervisor (s<rank>).
        self._peers = {b"%s%d" % (side, r.rank): r for r in self._ranks for side in (b"w", b"s")}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._call_ids = itertools.count()
        self._dead: WorkerDiedError | None = None
        self._stopping = False
        self._torn_down: list[
            WorkerDiedError
        ] = []  # exits torchrun caused, waiting for their cause
        self._blame_at = 0.0
        self._deadlines: list[tuple[float, int]] = []  # (deadline, call id), a heap
        self._last_tick = time.monotonic()
        self._started_at = time.monotonic()
        self._beat_timeout = float(config["heartbeat_timeout"])
        self._forward = bool(config["forward_output"])
        self._segments = SegmentMap()
        # A collect joins the ranks' large results by mapping them side by side (no copy).
        register_row_joiner(join_rows)
        self._pool: SegmentPool | None = None
        self._probe: str | None = None
        try:
            if shm_available():
                self._pool = SegmentPool(f"podium-{self.gid}-c-", **shm_keep(config))
                token = secrets.token_hex(16)
                probe = f"podium-{self.gid}-probe"
                # Private, and never through a link someone planted at that name.
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                with os.fdopen(os.open(os.path.join("/dev/shm", probe), flags, 0o600), "w") as f:
                    f.write(token)
                self._probe = f"{probe}:{token}"
            host = config["controller_host"] or "127.0.0.1"
            bind = config["bind_host"] or host
            self.channel = ControlChannel(
                world_size=self.world_size,
                bind_host=bind,
                advertise_host=host,
                on_message=self._on_message,
                on_tick=self._on_tick,
                name=f"podium-torchrun-{self.gid}",
            )
        except BaseException:
            # Nothing else will: a group that failed to construct is never shut down.
            if self._pool is not None:
                self._pool.close()
            unlink_prefix(f"podium-{self.gid}-")
            raise
        try:
            # Each rank's key pair waits in a private directory for its supervisor (0700, files 0600).
            self._key_dir = tempfile.mkdtemp(prefix="podium-keys-", dir=config.get("key_dir"))
            self.channel.keys.write_files(self._key_dir)
        except BaseException:
            self.channel.close()
            if self._pool is not None:
                self._pool.close()
            unlink_prefix(f"podium-{self.gid}-")
            raise
        self.channel.start()
        self.app_handle: str | None = None
        # The scheduler's log directory this group owns (local schedulers), kept if it failed.
        self.log_dir: str | None = None
        self.keep_logs = False
        # Set while the scheduler holds the app in its queue: start_timeout runs from
        # when it leaves (the backend's status check bounds the queueing itself).
        self.queued = False
        # What the scheduler kept of the app's output (its end), when it ended early.
        self.scheduler_log = ""
        # Set by the backend, which owns the torchx app: how to stop this group.
        self._closer: Callable[[TorchrunGroup], None] | None = None

    # -- environment for the workers ------------------------------------------

    def worker_env(self) -> dict[str, str]:
        env = dict(self.spec.worker_env)
        env.update(self.channel.keys.worker_env())
        env["PODIUM_TR_KEYS"] = self._key_dir
        env["PODIUM_TR_ADDR"] = self.channel.address
        env["PODIUM_TR_IPC"] = self.channel.ipc_address
        env["PODIUM_TR_GROUP"] = self.gid
        env["PODIUM_TR_USE_GPU"] = "1" if self.spec.pool.use_gpu else "0"
        env["PODIUM_TR_ORPHAN_TIMEOUT"] = str(self.config["orphan_timeout"])
        env["PODIUM_TR_BEAT"] = "0.5"
        env["PODIUM_TR_CONTROLLER"] = _this_process()
        # The shard server's address (empty: the worker host's own, see shardserver).
        env["PODIUM_TR_DATA_HOST"] = self.config.get("data_host") or ""
        if self.config.get("shard_network"):
            env[NETWORK_ENV] = "1"
        # PyTorch's CPU allocator puts tensors of 2 MiB and more in transparent huge
        # pages: a method's fresh result tensor then costs a fault per 2 MiB, not per
        # 4 KiB (a 64 MiB round trip ~20% faster here). The user's own setting wins.
        if _TORCH_THP_ENV not in env and _TORCH_THP_ENV not in os.environ:
            env[_TORCH_THP_ENV] = "1"
        if self._probe:
            env["PODIUM_TR_SHM_PROBE"] = self._probe
            keep = shm_keep(self.config)
            env["PODIUM_TR_SHM_KEEP"] = f"{keep['max_free']}:{keep['max_idle']}"
        return env

    # -- start ------------------------------------------------------------------

    def any_connected(self) -> bool:
        """Whether any rank ever connected (a group none reached has nothing to stop)."""
        return any(r.pid is not None for r in self._ranks)

    def wait_started(self, status: Any, timeout: float) -> None:
        """Wait until every rank said hello; ``status()`` reports the app ending early.

        ``status()`` may raise (a job queued too long) and sets :attr:`queued`;
        the ``timeout`` for connecting counts from when the app left the queue.
        """
        deadline = time.monotonic() + timeout
        next_status = 0.0
        with self._changed:
            while not all(r.connected for r in self._ranks):
                if self._dead is not None:
                    raise WorkerStartupError(
                        f"a worker of group {self.spec.name_prefix!r} ended during start-up: {self._dead}",
                        rank=self._dead.rank,
                        log_tail=self._dead.log_tail,
                    )
                now = time.monotonic()
                if self.queued:
                    deadline = now + timeout
                if now >= deadline:
                    missing = [r.rank for r in self._ranks if not r.connected]
                    raise WorkerStartupError(
                        f"ranks {missing} of group {self.spec.name_prefix!r} did not connect to the "
                        f"controller at {self.channel.address} within {timeout:g} s. If the workers run "
                        "on other hosts, set backend_options={'controller_host': '<this host's address>'}; "
                        "raise backend_options['start_timeout'] if the scheduler is slow.",
                        log_tail=self._all_tails(),
                    )
                if now >= next_status:
                    next_status = now + 0.5
                    self._changed.release()
                    try:
                        ended = status()
                    finally:
                        self._changed.acquire()
                    if ended:
                        raise WorkerStartupError(
                            f"the torchx app of group {self.spec.name_prefix!r} ended before every "
                            f"worker connected ({ended})",
                            log_tail="\n".join(t for t in (self._all_tails(), self.scheduler_log) if t),
                        )
                self._changed.wait(0.1)

    def init_workers(self, timeout: float) -> None:
        """Send the worker class to every rank; raise the first constructor error."""
        cwi = self.spec.cls_with_init
        enc = wire.encode(cwi)
        for r in self._ranks:
            desc, frames = wire.place(enc, self._pool if r.shm else None)
            self.channel.send(b"w%d" % r.rank, [wire.head(wire.INIT, ([desc], [])), *frames])
        wire.done_placing(enc, self._pool)
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(r.ready is not None for r in self._ranks):
                if self._dead is not None:
                    raise self._dead
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r.rank for r in self._ranks if r.ready is None]
                    raise WorkerStartupError(
                        f"ranks {missing} did not finish constructing {cwi!r} within {timeout:g} s; "
                        "raise backend_options['start_timeout'] if construction is slow",
                        log_tail=self._all_tails(),
                    )
                self._changed.wait(min(left, 0.5))
        for r in self._ranks:
            if r.ready is not None:
                r.ready.unwrap()

    # -- calls --------------------------------------------------------------------

    def submit(
        self, target: str, calls: Sequence[RankCall], *, timeout: float | None = None
    ) -> list[RankFuture]:
        if self._dead is not None:
            raise self._dead
        if getattr(self, "_podium_closed", False):
            raise RuntimeError(f"group {self.spec.name_prefix!r} was shut down")
        bare = True
        for call in calls:
            if not 0 <= call.rank < self.world_size:
                raise ValueError(
                    f"rank {call.rank} is not in this group (world size {self.world_size})"
                )
            if call.args or call.kwargs:
                bare = False
        if bare:
            return self._submit_bare(target, calls, timeout)
        # Serialize each distinct object once per call, however many ranks get it.
        encoded: dict[int, wire.Encoded] = {}
        keep: list[Any] = []
        # One id for the whole call: each rank keys its own pending calls.
        call_id, batch, deadline = self._open_call(len(calls), timeout)
        futures: list[RankFuture] = []
        outgoing: list[tuple[_Rank, TorchrunFuture, list[int], list[int], dict[str, int]]] = []
        for call in calls:
            state = self._ranks[call.rank]
            objs: list[int] = []  # this rank's distinct objects (ids), in message order
            index: dict[int, int] = {}
            arg_index = [_slot(a, encoded, keep, objs, index) for a in call.args]
            kw_index = {k: _slot(v, encoded, keep, objs, index) for k, v in call.kwargs.items()}
            fut = TorchrunFuture(call.rank, target, deadline, timeout, self.channel, batch)
            outgoing.append((state, fut, objs, arg_index, kw_index))
            futures.append(fut)
        # A message that carries shared memory goes out as soon as it is built,
        # so its rank starts while the next rank's data is copied in; small
        # ones go out together (one pass through the channel's lock).
        # Ranks that get the same objects in the same places (every rank of a
        # ONE_TO_ALL call) get the same head, pickled once. (``place`` runs
        # for every rank: it takes the rank's hold on a shared segment.)
        heads: dict[Any, bytes] = {}
        ready: list[tuple[bytes, list[Any]]] = []
        try:
            for state, fut, objs, arg_index, kw_index in outgoing:
                pool = self._pool if state.shm else None
                descs, frames = [], []
                for obj in objs:
                    desc, fr = wire.place(encoded[obj], pool)
                    descs.append(desc)
                    frames.extend(fr)
                key = (tuple(objs), pool is None, tuple(arg_index), tuple(kw_index.items()))
                with self._lock:
                    freed = self._enlist(state, call_id, fut, target)
                if freed:
                    meta = (call_id, target, descs, arg_index, kw_index, freed)
                    head = wire.head(wire.CALL, meta)
                else:
                    head = heads.get(key) or heads.setdefault(
                        key, wire.head(wire.CALL, (call_id, target, descs, arg_index, kw_index, []))
                    )
                ready.append((state.identity, [head, *frames]))
                if any(desc[0] == "s" for desc in descs):
                    self.channel.send_many(ready)
                    ready = []
            if ready:
                self.channel.send_many(ready)
        finally:
            for enc in encoded.values():
                wire.done_placing(enc, self._pool)
        return futures

    def _submit_bare(
        self, target: str, calls: Sequence[RankCall], timeout: float | None
    ) -> list[RankFuture]:
        """:meth:`submit` of a call without arguments: one :data:`.wire.CALL_BARE` head for all."""
        call_id, batch, deadline = self._open_call(len(calls), timeout)
        bare = wire.bare_call(call_id, target)
        futures: list[RankFuture] = []
        ready: list[tuple[bytes, list[Any]]] = []
        with self._lock:
            for call in calls:
                state = self._ranks[call.rank]
                fut = TorchrunFuture(call.rank, target, deadline, timeout, self.channel, batch)
                futures.append(fut)
                freed = self._enlist(state, call_id, fut, target)
                if freed:  # segments of this rank the controller no longer reads
                    head = wire.head(wire.CALL, (call_id, target, [], [], {}, freed))
                    ready.append((state.identity, [head]))
                else:
                    ready.append((state.identity, [bare]))
        self.channel.send_many(ready)
        return futures

    def _open_call(
        self, size: int, timeout: float | None
    ) -> tuple[int, CallBatch, float | None]:
        """A new call's id, its batch of ``size`` ranks, and its deadline, put on the expiry heap."""
        deadline = None if timeout is None else time.monotonic() + timeout
        call_id = next(self._call_ids)
        batch = CallBatch(size, call_id, self._expire)
        if deadline is not None:
            with self._lock:
                heapq.heappush(self._deadlines, (deadline, call_id))
        return call_id, batch, deadline

    def _enlist(self, state: _Rank, call_id: int, fut: TorchrunFuture, target: str) -> list[str]:
        """Files ``fut`` as the rank's pending call ``call_id``; returns the segments it may free.

        The caller holds ``self._lock``. A group that is stopping or has lost a
        rank takes no more calls (futures already sent were failed with the cause).
        """
        if self._stopping:
            raise GroupShutdownError(self.spec.name_prefix, method=target)
        if self._dead is not None:
            raise self._dead
        state.pending[call_id] = fut
        freed, state.freed = state.freed, []
        return freed

    # -- the I/O thread's handlers ------------------------------------------------

    def _on_message(self, identity: bytes, head: bytes, frames: list[Any]) -> None:
        state = self._peers.get(identity)
        if state is None:
            return
        state.last_beat = time.monotonic()
        kind = head[:1]
        if kind == wire.RESULT_NONE:  # most replies
            with self._lock:
                fut = state.pending.pop(int.from_bytes(head[1:9], "little"), None)
            if fut is not None:
                fut._resolve(RETURNED_NONE)
            self._collect_freed()
            return
        if kind == wire.LOG:
            self._print(state, head[1:2], frames[0].bytes)
            return
        if kind == wire.STALL:
            self._on_stall(state, int(head[1:] or 0))
            return
        _, meta = wire.split_head(head)
        if kind == wire.RESULT:
            key, desc, released = meta
            if self._pool is not None and released:
                self._pool.release(released)
            with self._lock:
                fut = state.pending.pop(key, None)
            try:
                (outcome,) = wire.decode_objects([desc], frames, self._segments)
            except Exception as exc:  # the rank's return value does not unpickle here
                outcome = crossing_failure(exc, state.rank, fut.method if fut else "", RESULT_NOT_LOADED)
            if fut is not None:
                fut._resolve(outcome)
            self._collect_freed()
        elif kind == wire.BEAT:
            pass
        elif kind == wire.HELLO:
            info = meta
            with self._changed:
                state.pid = info["pid"]
                state.host = info["host"]
                state.shm = bool(info["shm"]) and self._pool is not None
                state.connected = True
                self._changed.notify_all()
        elif kind == wire.READY:
            _key, desc, released = meta
            if self._pool is not None and released:
                self._pool.release(released)
            try:
                (outcome,) = wire.decode_objects([desc], frames, self._segments)
            except Exception as exc:
                outcome = crossing_failure(exc, state.rank, "__init__", RESULT_NOT_LOADED)
            with self._changed:
                state.ready = outcome
                self._changed.notify_all()
        elif kind == wire.EXIT:
            info = meta
            with self._changed:
                state.exited = True
                self._changed.notify_all()
            if self._stopping:
                return
            tail = "\n".join(info.get("tail") or list(state.tail))
            cause = info.get("cause")
            error = WorkerDiedError(
                state.rank,
                exit_code=info.get("exit_code"),
                signal=info.get("signal"),
                log_tail=tail,
                detail=f"pid {state.pid} on {state.host}" + (f"; {cause}" if cause else ""),
            )
            if info.get("torn_down") and self._dead is None:
                # torchrun stopped this rank because something else ended first:
                # wait a moment for that report (see _blame).
                self._torn_down.append(error)
                self._blame_at = self._blame_at or time.monotonic() + _ROOT_CAUSE_WAIT
                return
            self._mark_dead(error)

    def _collect_freed(self) -> None:
        if not self._segments.released:  # the usual case, on every reply
            return
        freed = self._segments.take_releases()
        if freed:
            # Segments live in the worker's pool; its prefix says whose.
            by_rank: dict[int, list[str]] = {}
            for name in freed:
                owner = name.rsplit("-", 2)[-2]
                if owner.startswith("w") and owner[1:].isdigit():
                    by_rank.setdefault(int(owner[1:]), []).append(name)
            with self._lock:
                for rank, names in by_rank.items():
                    if 0 <= rank < self.world_size:
                        self._ranks[rank].freed.extend(names)

    def _on_tick(self, now: float) -> None:
        if now - self._last_tick > _PAUSED_AFTER:
            # This process did not tick for a while (stopped, or a call held the
            # GIL): whatever was not heard meanwhile says nothing about the workers.
            for r in self._ranks:
                r.last_beat = max(r.last_beat, now)
        self._last_tick = now
        for r in self._ranks:
            self.channel.post(b"s%d" % r.rank, [wire.PING])
        while self._deadlines and self._deadlines[0][0] <= now:
            with self._lock:
                _, call_id = heapq.heappop(self._deadlines)
            self._expire(call_id)
        self._collect_freed()
        self._segments.trim()  # workers' segments they removed: unmap them here too
        shared_reads().trim()  # and exported ones that materialize() mapped
        if self._pool is not None:
            self._pool.trim()
        for r in self._ranks:
            if r.freed and r.connected:
                with self._lock:
                    freed, r.freed = r.freed, []
                self.channel.post(b"w%d" % r.rank, [wire.head(wire.FREE, freed)])
        if self._dead is not None or self._stopping:
            return
        if self._torn_down and now >= self._blame_at:
            self._blame(now)
            return
        for r in self._ranks:
            if r.connected and now - r.last_beat > self._beat_timeout:
                self._mark_dead(
                    WorkerDiedError(
                        r.rank,
                        log_tail="\n".join(r.tail),
                        detail=(
                            f"no heartbeat from pid {r.pid} on {r.host} for {self._beat_timeout:g} s "
                            "(host lost, or the process and its supervisor were killed)"
                        ),
                    )
                )
                return

    def _on_stall(self, state: _Rank, seconds: int) -> None:
        """The supervisor of ``state`` says its worker has been stopped for ``seconds``."""
        if self._dead is None and not self._stopping and seconds >= self._beat_timeout:
            self._mark_dead(
                WorkerDiedError(
                    state.rank,
                    log_tail="\n".join(state.tail),
                    detail=(
                        f"pid {state.pid} on {state.host} has been stopped (state T: SIGSTOP, "
                        f"SIGTSTP or a job-control stop) for {seconds} s, and the group cannot "
                        "make progress without it"
                    ),
                )
            )

    def _blame(self, now: float) -> None:
        """Name the root cause after torchrun stopped ranks and no rank reported why.

        A rank whose supervisor went silent (killed, or its host lost) is the
        cause; torchrun's SIGTERM to the others is a consequence. With none
        silent, torchrun's agent was told to stop (a cancelled job, a signal).
        """
        torn = self._torn_down
        stopped = ", ".join(
            f"rank {e.rank} (signal {e.signal})"
            if e.signal
            else f"rank {e.rank} (exit code {e.exit_code})"
            for e in torn
        )
        quiet = [
            r
            for r in self._ranks
            if r.connected and not r.exited and now - r.last_beat > 2 * _ROOT_CAUSE_WAIT / 3
        ]
        if quiet:
            r = min(quiet, key=lambda q: q.last_beat)
            error = WorkerDiedError(
                r.rank,
                log_tail="\n".join(r.tail),
                detail=(
                    f"pid {r.pid} on {r.host}: its supervisor went away without a report (killed, "
                    f"or its host lost); torchrun then stopped {stopped}"
                ),
            )
        else:
            first = torn[0]
            error = WorkerDiedError(
                first.rank,
                exit_code=first.exit_code,
                signal=first.signal,
                log_tail=first.log_tail,
                detail=(
                    f"torchrun's agent stopped {stopped} without another rank failing first "
                    "(the job was cancelled, or torchrun was signalled)"
                ),
            )
        self._mark_dead(error)

    def _expire(self, call_id: int) -> None:
        """The deadline of call ``call_id`` passed: fail its futures and interrupt it where it runs."""
        with self._lock:
            late = [(r, r.pending.pop(call_id)) for r in self._ranks if call_id in r.pending]
        late = [(r, f) for r, f in late if not f.done()]
        if not late:
            return
        ranks = [r.rank for r, _ in late]
        for r, _ in late:
            self.channel.send(b"s%d" % r.rank, [wire.CANCEL + b"%d" % call_id])
        fut = late[0][1]
        error = CallTimeoutError(
            fut.method,
            fut._timeout or 0.0,
            ranks,
            detail=(
                f"it was still running on ranks {ranks}; podium interrupts it there, so that later "
                "calls do not wait behind it (a method inside a long C call stops when that call "
                "returns to Python)"
            ),
        )
        for _, f in late:
            f._fail(error)

    def _mark_dead(self, error: WorkerDiedError) -> None:
        with self._changed:
            if self._dead is None:
                self._dead = error
            pending = [f for r in self._ranks for f in r.pending.values()]
            for r in self._ranks:
                r.pending.clear()
            self._changed.notify_all()
        for fut in pending:
            fut._fail(self._dead)

    def _print(self, state: _Rank, stream: bytes, data: bytes) -> None:
        text = state.partial.get(stream, b"") + data
        *lines, state.partial[stream] = text.split(b"\n")
        out = sys.stdout if stream == b"1" else sys.stderr
        prefix = f"[rank {state.rank}] "
        chunk = []
        for line in lines:
            decoded = line.decode(errors="replace")
            state.tail.append(decoded)
            chunk.append(prefix + decoded + "\n")
        if self._forward and chunk:
            try:
                out.write("".join(chunk))
                out.flush()
            except (ValueError, OSError):
                pass

    def _all_tails(self) -> str:
        parts = []
        for r in self._ranks:
            if r.tail:
                parts.append("\n".join(f"[rank {r.rank}] {line}" for line in r.tail))
        return "\n".join(parts)

    # -- shutdown -----------------------------------------------------------------------

    def stop_workers(self, wait: float, grace: float = SHUTDOWN_GRACE) -> bool:
        """Stop every worker; wait up to ``wait`` s for their supervisors' reports.

        Calls still pending fail at once with :class:`GroupShutdownError`; the
        call a worker runs is interrupted and queued ones are skipped. Each
        worker then runs its ``shutdown()`` hook and exits normally (``atexit``
        handlers run); its supervisor kills it if it takes over ``grace`` s.
        Returns whether every worker was seen to end.
        """
        with self._changed:
            self._stopping = True
            pending = [f for r in self._ranks for f in r.pending.values()]
            for r in self._ranks:
                r.pending.clear()
            self._changed.notify_all()
        for fut in pending:
            fut._fail(
                GroupShutdownError(self.spec.name_prefix, method=fut.method, ranks=[fut.rank])
            )
        self.channel.wake_waiters()
        quit_now = wire.QUIT + b"%g" % grace
        self.channel.send_many(
            [
                m
                for r in self._ranks
                for m in ((b"s%d" % r.rank, [quit_now]), (b"w%d" % r.rank, [wire.STOP]))
            ]
        )

        def ended() -> bool:
            now = time.monotonic()
            return all(r.exited or not r.connected or now - r.last_beat > 2.0 for r in self._ranks)

        return wait > 0 and self.channel.wait(ended, wait)

    def close_channel(self) -> None:
        self.channel.close()
        shutil.rmtree(self._key_dir, ignore_errors=True)
        self._segments.close()
        if self._pool is not None:
            self._pool.close()
        unlink_prefix(f"podium-{self.gid}-")

    def handles(self) -> TorchrunHandles:
        return TorchrunHandles(
            pids=[r.pid for r in self._ranks],
            hosts=[r.host for r in self._ranks],
            control_address=self.channel.address,
            app_handle=self.app_handle,
        )

    def _shutdown(self) -> None:
        # The backend owns the torchx app; it registered itself as the closer.
        if self._closer is None:
            self.stop_workers(0)
            self.close_channel()
        elif self.channel.held_here():
            # Called from within the channel's own thread of control (a group
            # dropped and collected while this thread served the channel): the
            # channel cannot be closed from inside, so finish on another thread.
            threading.Thread(
                target=self._closer, args=(self,), name=f"podium-torchrun-close-{self.gid}"
            ).start()
        else:
            self._closer(self)


def _this_process() -> str:
    """``pid:start time`` of this process, by which supervisors on this host see whether it lives."""
    try:
        with open("/proc/self/stat") as f:
            return f"{os.getpid()}:{f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):  # no procfs: supervisors go by the connection alone
        return ""


def _slot(
    value: Any,
    encoded: dict[int, wire.Encoded],
    keep: list[Any],
    objs: list[int],
    index: dict[int, int],
) -> int:
    """Position of ``value`` in one rank's message, encoding it once per call (by identity)."""
    key = id(value)
    if key not in encoded:
        encoded[key] = wire.encode(value)
        keep.append(value)  # keeps id() unique while the call is built
    if key not in index:
        index[key] = len(objs)
        objs.append(key)
    return index[key]
