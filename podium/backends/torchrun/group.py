"""One running group of torchrun-launched workers, as the controller sees it.

The group owns its :class:`~podium.backends.torchrun.channel.ControlChannel`
and the torchx app. Everything the workers send arrives on whichever thread
serves the channel -- a caller waiting for results, or the channel's I/O
thread when no caller is active -- in :meth:`TorchrunGroup._on_message`,
which resolves futures, prints forwarded output with a rank prefix, and turns
a supervisor's exit report or a missed heartbeat into
:class:`~podium.errors.WorkerDiedError` for every pending and later call.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from podium.backends.torchrun import wire
from podium.backends.torchrun.channel import ControlChannel
from podium.backends.torchrun.futures import CallBatch, TorchrunFuture
from podium.backends.torchrun.shm import (
    SegmentMap,
    SegmentPool,
    shm_available,
    shm_keep,
    unlink_prefix,
)
from podium.core.backend import BackendGroup, GroupSpec, RankCall
from podium.core.futures import RankFuture
from podium.core.host import Outcome
from podium.errors import WorkerDiedError, WorkerStartupError

__all__ = ["TorchrunFuture", "TorchrunGroup"]

log = logging.getLogger("podium.torchrun")

_TAIL_LINES = 40


@dataclass
class _Rank:
    rank: int
    identity: bytes = b""  # its worker's ZeroMQ identity
    pid: int | None = None
    host: str | None = None
    shm: bool = False
    connected: bool = False
    last_beat: float = 0.0
    pending: dict[int, TorchrunFuture] = field(default_factory=dict)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    partial: dict[bytes, bytes] = field(default_factory=dict)
    freed: list[str] = field(default_factory=list)  # worker segments the controller is done with
    ready: Outcome | None = None


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
        self._started_at = time.monotonic()
        self._beat_timeout = float(config["heartbeat_timeout"])
        self._forward = bool(config["forward_output"])
        self._segments = SegmentMap()
        self._pool: SegmentPool | None = None
        self._probe: str | None = None
        if shm_available():
            self._pool = SegmentPool(f"podium-{self.gid}-c-", **shm_keep(config))
            token = secrets.token_hex(16)
            probe = f"podium-{self.gid}-probe"
            with open(os.path.join("/dev/shm", probe), "w") as f:
                f.write(token)
            self._probe = f"{probe}:{token}"
        host = config["controller_host"] or "127.0.0.1"
        bind = config["bind_host"] or host
        self.channel = ControlChannel(
            bind_host=bind,
            advertise_host=host,
            on_message=self._on_message,
            on_tick=self._on_tick,
            name=f"podium-torchrun-{self.gid}",
        )
        self.channel.start()
        self.app_handle: str | None = None
        # The scheduler's log directory this group owns (local schedulers), kept if it failed.
        self.log_dir: str | None = None
        self.keep_logs = False
        # Set by the backend, which owns the torchx app: how to stop this group.
        self._closer: Callable[[TorchrunGroup], None] | None = None

    # -- environment for the workers ------------------------------------------

    def worker_env(self) -> dict[str, str]:
        env = dict(self.spec.worker_env)
        env.update(self.channel.keys.worker_env())
        env["PODIUM_TR_ADDR"] = self.channel.address
        env["PODIUM_TR_IPC"] = self.channel.ipc_address
        env["PODIUM_TR_GROUP"] = self.gid
        env["PODIUM_TR_USE_GPU"] = "1" if self.spec.pool.use_gpu else "0"
        env["PODIUM_TR_ORPHAN_TIMEOUT"] = str(self.config["orphan_timeout"])
        env["PODIUM_TR_BEAT"] = "0.5"
        if self._probe:
            env["PODIUM_TR_SHM_PROBE"] = self._probe
            keep = shm_keep(self.config)
            env["PODIUM_TR_SHM_KEEP"] = f"{keep['max_free']}:{keep['max_idle']}"
        return env

    # -- start ------------------------------------------------------------------

    def wait_started(self, status: Any, timeout: float) -> None:
        """Wait until every rank said hello; ``status()`` reports the app ending early."""
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
                            log_tail=self._all_tails(),
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
        # Serialize each distinct object once per call, however many ranks get it.
        encoded: dict[int, wire.Encoded] = {}
        keep: list[Any] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        # One id for the whole call: each rank keys its own pending calls.
        call_id = next(self._call_ids)
        batch = CallBatch(len(calls))
        futures: list[RankFuture] = []
        outgoing: list[tuple[_Rank, TorchrunFuture, list[int], list[int], dict[str, int]]] = []
        for call in calls:
            if not 0 <= call.rank < self.world_size:
                raise ValueError(
                    f"rank {call.rank} is not in this group (world size {self.world_size})"
                )
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
                    if self._dead is not None:
                        raise self._dead  # futures already sent were failed with it
                    state.pending[call_id] = fut
                    freed, state.freed = state.freed, []
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

    # -- the I/O thread's handlers ------------------------------------------------

    def _on_message(self, identity: bytes, head: bytes, frames: list[Any]) -> None:
        state = self._peers.get(identity)
        if state is None:
            return
        state.last_beat = time.monotonic()
        kind = head[:1]
        if kind == wire.LOG:
            self._print(state, head[1:2], frames[0].bytes)
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
            except Exception as exc:
                if fut is not None:
                    fut._fail(exc)
            else:
                if fut is not None:
                    fut._resolve(outcome)
            self._collect_freed(state)
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
            (outcome,) = wire.decode_objects([desc], frames, self._segments)
            with self._changed:
                state.ready = outcome
                self._changed.notify_all()
        elif kind == wire.EXIT:
            info = meta
            if self._stopping and info.get("exit_code") == 0:
                return
            tail = "\n".join(info.get("tail") or list(state.tail))
            self._mark_dead(
                WorkerDiedError(
                    state.rank,
                    exit_code=info.get("exit_code"),
                    signal=info.get("signal"),
                    log_tail=tail,
                    detail=f"pid {state.pid} on {state.host}",
                )
            )

    def _collect_freed(self, state: _Rank) -> None:
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
        for r in self._ranks:
            self.channel.post(b"s%d" % r.rank, [wire.PING])
        self._collect_freed(self._ranks[0])
        self._segments.trim()  # workers' segments they removed: unmap them here too
        if self._pool is not None:
            self._pool.trim()
        for r in self._ranks:
            if r.freed and r.connected:
                with self._lock:
                    freed, r.freed = r.freed, []
                self.channel.post(b"w%d" % r.rank, [wire.head(wire.FREE, freed)])
        if self._dead is not None or self._stopping:
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

    def stop_workers(self, wait: float) -> None:
        """Ask every worker to exit and wait (up to ``wait`` s) for their supervisors' reports."""
        self._stopping = True
        for r in self._ranks:
            self.channel.send(b"w%d" % r.rank, [wire.STOP])
        if self._dead is None:
            self._mark_dead(WorkerDiedError(None, detail="the group was shut down"))

    def close_channel(self) -> None:
        self.channel.close()
        self._segments.close()
        if self._pool is not None:
            self._pool.close()
        unlink_prefix(f"podium-{self.gid}-")

    def _shutdown(self) -> None:
        # The backend owns the torchx app; it registered itself as the closer.
        if self._closer is not None:
            self._closer(self)
        else:
            self.stop_workers(0)
            self.close_channel()


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
