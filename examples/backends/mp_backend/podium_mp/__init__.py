"""``mp``: a minimal podium backend -- one local process per rank, over ``multiprocessing.connection``.

An example of :mod:`podium.backend_api`, small enough to read in one sitting
(``docs/writing-a-backend.md`` walks through it). Ranks are processes on this
machine started with ``subprocess`` (so ``worker_env`` is in their starting
environment); each talks to the controller over an authenticated local socket.
Payloads are pickled with podium's :func:`dumps` and sent in one message each,
buffers inline (a production backend sends the buffers out of band).
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from podium.backend_api import (
    RESULT_NOT_LOADED,
    Backend,
    BackendGroup,
    BackendOption,
    CallTimeoutError,
    Capabilities,
    GroupShutdownError,
    GroupSpec,
    RankCall,
    RankFuture,
    ResourcePool,
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerStartupError,
    crossing_failure,
    dumps,
    loads,
    rank_infos,
)

__all__ = ["MultiprocessingBackend"]

WORKER = str(Path(__file__).with_name("worker.py"))


class MpFuture(RankFuture):
    def __init__(self, rank: int, method: str, timeout: float | None) -> None:
        super().__init__(rank, method)
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        if not self._event.is_set():
            self._value, self._error = value, error
            self._event.set()

    def result(self, timeout: float | None = None) -> Any:
        waits = [
            t
            for t in (timeout, self._deadline and self._deadline - time.monotonic())
            if t is not None
        ]
        if not self._event.wait(max(0.0, min(waits)) if waits else None):
            raise CallTimeoutError(self.method, self._timeout or timeout or 0.0, [self.rank])
        if self._error is not None:
            raise self._error
        return self._value.unwrap()  # an Outcome: the value, or the worker's exception

    def done(self) -> bool:
        return self._event.is_set()


class MpGroup(BackendGroup):
    def __init__(self, spec: GroupSpec, start_timeout: float, stop_timeout: float) -> None:
        self._stop_timeout = stop_timeout
        self.name = spec.name_prefix
        self.world_size = spec.pool.world_size
        self.worker_names = [f"{spec.name_prefix}_{rank}" for rank in range(self.world_size)]
        self._lock = threading.Lock()
        self._pending: dict[int, MpFuture] = {}
        self._ids = itertools.count()
        self._dead: WorkerDiedError | None = None
        self._closed = False
        self._logs = [tempfile.TemporaryFile() for _ in range(self.world_size)]
        authkey = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = {
            **os.environ,
            **spec.worker_env,
            "PODIUM_MP_HOST": "127.0.0.1",
            "PODIUM_MP_PORT": str(listener.address[1]),
            "PODIUM_MP_AUTHKEY": authkey.hex(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(self.world_size),
        }
        infos = rank_infos(spec.pool, master_addr="127.0.0.1", master_port=int(env["MASTER_PORT"]))
        self._procs = [
            subprocess.Popen(
                [sys.executable, WORKER],
                env={
                    **env,
                    "RANK": str(i.rank),
                    "LOCAL_RANK": str(i.local_rank),
                    "LOCAL_WORLD_SIZE": str(i.local_world_size),
                },
                stdout=self._logs[i.rank],
                stderr=subprocess.STDOUT,
            )
            for i in infos
        ]
        try:
            self._conns = self._accept(listener, start_timeout)
            for info, conn in zip(infos, self._conns):
                conn.send_bytes(dumps(("init", info, spec.cls_with_init), out_of_band=False)[0])
            started = [self._receive_init(rank, start_timeout) for rank in range(self.world_size)]
        except BaseException:
            self._kill()
            raise
        finally:
            listener.close()
        self._send_locks = [threading.Lock() for _ in range(self.world_size)]
        for rank in range(self.world_size):
            threading.Thread(
                target=self._read, args=(rank,), daemon=True, name=f"podium-mp-{rank}"
            ).start()
        failed = [outcome for outcome in started if not outcome.ok]
        if failed:
            self.shutdown()
            failed[0].unwrap()  # the user's constructor raised: raise it here

    # -- starting ---------------------------------------------------------------

    def _accept(self, listener: Listener, timeout: float) -> list[Any]:
        conns: list[Any] = [None] * self.world_size
        done = threading.Event()

        def accept() -> None:
            for _ in range(self.world_size):
                conn = listener.accept()
                conns[int(conn.recv_bytes())] = conn
            done.set()

        threading.Thread(target=accept, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not done.wait(0.1):
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    raise self._startup_error(
                        rank, f"rank {rank} exited with code {proc.returncode} while starting"
                    )
            if time.monotonic() > deadline:
                raise self._startup_error(
                    None, f"ranks did not connect within {timeout:g} s (start_timeout)"
                )
        return conns

    def _receive_init(self, rank: int, timeout: float) -> Any:
        conn = self._conns[rank]
        while not conn.poll(0.1):
            if self._procs[rank].poll() is not None:
                raise self._startup_error(
                    rank,
                    f"rank {rank} exited with code {self._procs[rank].returncode} in its constructor",
                )
            timeout -= 0.1
            if timeout <= 0:
                raise self._startup_error(
                    rank, f"the constructor of rank {rank} did not finish in time (start_timeout)"
                )
        return loads(loads(conn.recv_bytes())[1])

    def _startup_error(self, rank: int | None, message: str) -> WorkerStartupError:
        log = self._logs[rank or 0]
        log.seek(0)
        tail = "\n".join(log.read().decode(errors="replace").splitlines()[-50:])
        return WorkerStartupError(message, rank=rank, log_tail=tail)

    # -- calling ----------------------------------------------------------------

    def submit(
        self, target: str, calls: Sequence[RankCall], *, timeout: float | None = None
    ) -> list[RankFuture]:
        # Pickle every argument first: one that does not pickle raises here and no rank runs.
        payloads = [dumps((call.args, call.kwargs), out_of_band=False)[0] for call in calls]
        futures = []
        for call, payload in zip(calls, payloads):
            future = MpFuture(call.rank, target, timeout)
            futures.append(future)
            with self._lock:
                if self._closed or self._dead is not None:
                    future._set(
                        error=self._dead
                        or GroupShutdownError(self.name, method=target, ranks=[call.rank])
                    )
                    continue
                call_id = next(self._ids)
                self._pending[call_id] = future
            try:
                with self._send_locks[
                    call.rank
                ]:  # the worker's reader always receives: no wait on a busy rank
                    self._conns[call.rank].send_bytes(
                        dumps(("call", call_id, target), out_of_band=False)[0]
                    )
                    self._conns[call.rank].send_bytes(payload)
            except OSError:
                pass  # the rank is gone: its reader fails this future as it fails the group
        return list(futures)

    def _read(self, rank: int) -> None:
        conn = self._conns[rank]
        while True:
            try:
                call_id, blob = loads(conn.recv_bytes())
            except (EOFError, OSError):
                return self._rank_gone(rank)
            with self._lock:
                future = self._pending.pop(call_id, None)
            if future is None:
                continue  # the group was shut down meanwhile
            try:
                future._set(loads(blob))
            except Exception as exc:  # a result that does not unpickle here fails its call only
                future._set(crossing_failure(exc, rank, future.method, RESULT_NOT_LOADED))

    def _rank_gone(self, rank: int) -> None:
        code = self._procs[rank].wait()
        with self._lock:
            if self._closed:
                return
            self._dead = WorkerDiedError(rank, exit_code=code)
            pending, self._pending = self._pending, {}
        for future in pending.values():  # a dead rank fails every pending call of the group
            future._set(error=self._dead)

    # -- stopping ---------------------------------------------------------------

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future._set(
                error=GroupShutdownError(self.name, method=future.method, ranks=[future.rank])
            )
        for rank, conn in enumerate(getattr(self, "_conns", [])):
            try:
                with self._send_locks[rank]:
                    conn.send_bytes(dumps(("close",), out_of_band=False)[0])
            except OSError:
                pass
        self._kill(grace=self._stop_timeout)

    def _kill(self, grace: float = 0.0) -> None:
        deadline = time.monotonic() + grace
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MultiprocessingBackend(Backend):
    """One local process per rank; CPU only, one node."""

    name = "mp"
    capabilities = Capabilities(
        process_group=True, call_timeout=True, detects_dead_workers=True, worker_env=True
    )
    options = (
        BackendOption("start_timeout", (int, float), 120.0, "seconds for every rank to start"),
        BackendOption(
            "stop_timeout",
            (int, float),
            5.0,
            "seconds a stopping rank may take to run its hook and exit",
        ),
    )

    def check_resources(self, pools: Sequence[ResourcePool]) -> None:
        for pool in pools:
            if pool.use_gpu:
                raise ResourceUnavailableError(
                    "the 'mp' backend has no GPUs: make the pool with use_gpu=False",
                    demand={"GPU": pool.world_size},
                    supply={"GPU": 0},
                )
            if len(pool.store) > 1:
                raise ResourceUnavailableError(
                    f"the 'mp' backend runs on one node; pool {pool.name_prefix!r} has {len(pool.store)}",
                    demand={"nodes": len(pool.store)},
                    supply={"nodes": 1},
                )

    def _start_group(self, spec: GroupSpec) -> BackendGroup:
        return MpGroup(
            spec, float(self.config["start_timeout"]), float(self.config["stop_timeout"])
        )
