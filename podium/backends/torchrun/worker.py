"""The worker entry point torchrun runs (see :data:`.launch.BOOT`).

Each torchrun process splits in two at once:

- the **worker** (a child) connects to the controller, waits for the
  worker class, builds it with a :class:`podium.core.host.WorkerHost` and
  runs calls one at a time in submission order. It imports nothing of the
  user's until the controller sends the class.
- the **supervisor** (the process torchrun started) stays small: it owns the
  worker's stdout/stderr pipes and forwards their lines to the controller
  (and to its own output, which torchrun/torchx keep in their logs), sends
  heartbeats, and reports how the worker ended -- exit code or signal and the
  last lines -- the moment it ends. A busy worker holding the GIL cannot miss a
  heartbeat this way, and a ``SIGKILL`` or ``os._exit`` is reported within
  milliseconds; so is a worker that is stopped (state ``T``). When the
  controller is gone (on its host: its process has exited; elsewhere: no word
  from it and no connection for ``orphan_timeout``), the supervisor kills the
  worker and exits. A controller that is only paused (``SIGSTOP``, a long call
  holding its GIL) is waited for. The supervisor also passes on the
  controller's requests to interrupt a call (its deadline passed, or the group
  stops): see :class:`_Control`.

torchrun loads this file by its path, not as ``podium.backends.torchrun.worker``:
importing a module of the package imports ``podium`` (torch, tensordict),
~2 s of CPU that the supervisor never needs; only the worker imports it, after
the fork, with ``torch._dynamo`` deferred (:mod:`.lazy_dynamo`). So nothing
here imports podium at module level. (``python -m`` still works.)

Everything arrives through the environment (``PODIUM_TR_*``, set by the
controller) and torchrun (``RANK``, ``LOCAL_RANK``, ... ``MASTER_PORT``),
except the rank's CURVE key pair: the supervisor reads it from a file only
this user can read (``$PODIUM_TR_KEYS/rank-<rank>``) and deletes the file
before it forks, so the secret is never in an environment or on disk for
longer than the start-up; the worker inherits it in memory.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import deque
from typing import Any

import msgpack  # small (no torch): the supervisor's exit report, as wire.head encodes it

__all__ = ["main"]

_TAIL_LINES = 40
# The supervisor's message kinds (wire.BEAT, wire.LOG, wire.EXIT): spelled out
# here because importing wire pulls in torch, and the supervisor stays small.
_BEAT, _LOG, _EXIT = b"B", b"L", b"X"
# wire.STALL (supervisor -> controller); wire.PING, wire.CANCEL, wire.QUIT (controller -> supervisor).
_STALL, _PING, _CANCEL, _QUIT = b"T", b"P", b"K", b"Q"
# The signal by which a supervisor tells its worker to read its control pipe.
_CONTROL_SIGNAL = signal.SIGUSR2


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        sys.stderr.write(
            f"podium torchrun worker: {name} is not set. This entry point is started by "
            "podium's torchrun backend (WorkerGroup(..., backend='torchrun')), not by hand.\n"
        )
        sys.exit(2)
    return value


def _read_keys(rank: int) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """This rank's CURVE key pair (public, secret) and its controller's reader pair (which
    reads shards from shard servers), from the file the controller left; the file is deleted
    (and the directory, by the last rank to read)."""
    directory = _env("PODIUM_TR_KEYS")
    path = os.path.join(directory, f"rank-{rank}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            public, secret, reader_public, reader_secret = f.read().split()
    except (OSError, ValueError) as exc:
        sys.stderr.write(
            f"podium torchrun worker: cannot read this rank's key file {path} ({exc}). The "
            "controller writes it before the job starts; on a multi-node scheduler "
            "backend_options['key_dir'] must be a directory that every node sees under the same "
            "path (a shared filesystem).\n"
        )
        sys.exit(2)
    for remove, leftover in ((os.unlink, path), (os.rmdir, directory)):
        try:
            remove(leftover)
        except OSError:
            pass  # another rank's file is still there: it removes the directory
    return (public, secret), (reader_public, reader_secret)


def _zmq_io_threads() -> list[int]:
    """Ids of this process's ZeroMQ I/O threads (Linux's ``/proc``; empty elsewhere)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg/IO"):
                    found.append(int(tid))
        except OSError:
            pass  # ended meanwhile
    return found


def _io_threads_yield() -> None:
    """Run this process's ZeroMQ I/O threads under ``SCHED_BATCH``.

    A rank's main thread sends its reply and goes straight back to wait for the
    next call. The send wakes the context's I/O thread, which under the default
    policy preempts the main thread mid-send when every CPU is busy: measured with
    four ranks on two cores, about two preemptions of ranks' main threads per
    no-op call, and with ``SCHED_BATCH`` 0.15-0.2 (the call 3-6% faster). A
    ``SCHED_BATCH`` thread never preempts on waking; it runs once the main thread
    blocks in its next receive, or at once on an idle CPU, and keeps its fair share
    of CPU (a rank busy in a training step still gets its messages). libzmq's own
    ``ZMQ_THREAD_SCHED_POLICY`` is not used: it aborts the process where the system
    refuses the policy, and here a refusal only leaves the default.

    Called once the rank's call socket exists (a context's threads start with its
    first socket), while that is the process's only ZeroMQ context.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return
    # libzmq names its threads as they start: the I/O thread may still be unnamed.
    deadline = time.monotonic() + 0.5
    while not (tids := _zmq_io_threads()) and time.monotonic() < deadline:
        time.sleep(0.001)
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:
            pass  # not allowed here (a restricted container): the default policy stays


def _connect(
    identity: bytes,
    keys: tuple[bytes, bytes],
    heartbeat_timeout: float = 0.0,
    monitor_events: int = 0,
) -> tuple[Any, Any, Any]:
    """A CURVE DEALER connected to the controller, and a monitor of ``monitor_events`` on it
    (None without); the monitor is attached before the connect, so no event is missed."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if heartbeat_timeout > 0:
        # ZMTP heartbeats: answered by the controller's ZeroMQ I/O thread, which
        # needs no GIL, so a controller busy in Python keeps its connections;
        # one whose host is gone loses them after ``heartbeat_timeout``.
        sock.heartbeat_ivl = 1000
        sock.heartbeat_timeout = int(heartbeat_timeout * 1000)
    sock.linger = 2000
    sock.sndhwm = 0
    sock.rcvhwm = 0
    sock.identity = identity
    sock.curve_serverkey = _env("PODIUM_TR_SERVER_KEY").encode()
    sock.curve_publickey, sock.curve_secretkey = keys
    # A monitor reports only what happens after it is attached: a handshake that
    # completed first would leave the connection's watcher believing it is down.
    monitor = sock.get_monitor_socket(monitor_events) if monitor_events else None
    sock.connect(_address())
    return ctx, sock, monitor


def _address() -> str:
    """The controller's Unix socket when this process shares its host, else its TCP address."""
    ipc = os.environ.get("PODIUM_TR_IPC", "")
    path = ipc[len("ipc://") :]
    # The shared-memory probe proves the same host (and /dev/shm namespace);
    # the path alone could be a network mount, where a Unix socket never connects.
    if ipc.startswith("ipc://") and os.path.exists(path) and _shm_probe_ok():
        return ipc
    return _env("PODIUM_TR_ADDR")


def _shm_prefix(rank: int | str) -> str:
    return f"podium-{_env('PODIUM_TR_GROUP')}-{rank}-"


def _shm_probe_ok() -> bool:
    """Whether this process sees the controller's /dev/shm (same host, same namespace)."""
    probe = os.environ.get("PODIUM_TR_SHM_PROBE", "")
    name, _, token = probe.partition(":")
    if not name or not token:
        return False
    try:
        with open(os.path.join("/dev/shm", name)) as f:
            return f.read() == token
    except OSError:
        return False


def _stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` from its third field (the state) on; [] if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _process_state(pid: int) -> str:
    fields = _stat(pid)
    return fields[0] if fields else ""


def _process_alive(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` (clock ticks after boot) still runs."""
    fields = _stat(pid)
    return len(fields) > 19 and fields[19] == start and fields[0] not in ("Z", "X")


def _controller_process() -> tuple[int, str] | None:
    """The controller's (pid, start time) when it runs on this host and this process can see it."""
    pid, _, start = os.environ.get("PODIUM_TR_CONTROLLER", "").partition(":")
    if not pid.isdigit() or not _shm_probe_ok() or not _process_alive(int(pid), start):
        return None  # another host, or another pid namespace
    return int(pid), start


def _sibling(name: str) -> Any:
    """A module next to this file, loaded by path (importing it by name would import podium)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_podium_torchrun_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _unlink_prefix(prefix: str) -> None:
    """Remove every /dev/shm segment whose name starts with ``prefix`` (as shm.unlink_prefix)."""
    import glob

    for path in glob.glob(os.path.join("/dev/shm", glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
        except OSError:
            pass


# -- the worker (child) --------------------------------------------------------


class CallInterrupted(BaseException):
    """Raised in a worker's main thread to end the call it runs.

    The controller gave up on the call (its deadline passed) or the group is
    shutting down. A ``BaseException``, so that a method's ``except Exception``
    does not swallow it. Python delivers it when the main thread next runs
    Python code: a method inside one long C call (a kernel, a blocking read
    without a timeout) stops only when that call returns.
    """


class _Control:
    """What the supervisor asked of this worker, through a pipe and a signal.

    The supervisor writes ``K<call id>`` (cancel that call) or ``Q`` (the group
    stops: cancel the running call and skip queued ones) and sends
    :data:`_CONTROL_SIGNAL`; the handler raises :class:`CallInterrupted` in the
    main thread only when the call that runs is one it was told to end.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.running: int | None = None  # the call id whose method runs now
        self.cancelled: set[int] = set()
        self.stopping = False

    def read(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except OSError:  # nothing to read (BlockingIOError) or the supervisor is gone
            return
        for line in data.split(b"\n"):
            if line == _QUIT:
                self.stopping = True
            elif line[:1] == _CANCEL and line[1:].isdigit():
                self.cancelled.add(int(line[1:]))

    def on_signal(self, _signum: int, _frame: Any) -> None:
        self.read()
        running = self.running
        if running is not None and (self.stopping or running in self.cancelled):
            self.running = None  # at most once per call
            why = "the group is shutting down" if self.stopping else "its deadline passed"
            raise CallInterrupted(f"call {running} was interrupted: {why}")

    def skip(self, call_id: int) -> bool:
        """Whether to drop a queued call instead of running it (and forget older cancellations)."""
        if not self.cancelled:
            return self.stopping
        hit = call_id in self.cancelled
        self.cancelled = {c for c in self.cancelled if c > call_id}
        return hit or self.stopping


_control = _Control(-1)


def _worker_main(rank: int, keys: tuple[bytes, bytes], reader: tuple[bytes, bytes]) -> None:
    import socket as _socket

    import zmq

    _sibling("lazy_dynamo").install()  # before anything imports torch

    import queue
    from concurrent.futures import ThreadPoolExecutor

    from podium.backends.torchrun import wire
    from podium.backends.torchrun.channel import raw_send, send_frames
    from podium.backends.torchrun.mappings import shared_reads
    from podium.backends.torchrun.shm import (
        MAX_FREE_BYTES,
        MAX_IDLE_S,
        SegmentMap,
        SegmentPool,
        tune_malloc,
    )
    from podium.core.host import (
        ARGUMENT_NOT_LOADED,
        RESULT_NOT_SENT,
        RETURNED_NONE,
        Outcome,
        RemoteFailure,
        WorkerHost,
        crossing_failure,
        is_async_target,
        max_async_calls,
        release_process_groups,
    )
    from podium.core.worker import RankInfo

    # This process is podium's own: keep large freed blocks in the heap so
    # that a method making a large tensor per call (``x * 2`` on a 16 MiB
    # shard) reuses mapped pages instead of page-faulting a fresh mmap each
    # time (see shm.tune_malloc; costs RSS, which stays at its high-water mark).
    tune_malloc()
    ctx, sock, _ = _connect(b"w%d" % rank, keys)
    _io_threads_yield()
    # Wake once a second while idle to remove shared memory nobody uses any more.
    sock.setsockopt(zmq.RCVTIMEO, 1000)
    shm_ok = _shm_probe_ok()
    segments = SegmentMap()
    keep = os.environ.get("PODIUM_TR_SHM_KEEP", f"{MAX_FREE_BYTES}:{MAX_IDLE_S}").split(":")
    pool = (
        SegmentPool(_shm_prefix(f"w{rank}"), max_free=int(keep[0]), max_idle=float(keep[1]))
        if shm_ok
        else None
    )
    exporter = _exporter(rank, keys, reader, max_free=int(keep[0]), max_idle=float(keep[1]))
    hello = {"rank": rank, "pid": os.getpid(), "host": _socket.gethostname(), "shm": shm_ok}
    send_frames(sock, [wire.head(wire.HELLO, hello)])
    host: WorkerHost | None = None
    control = _control

    def reply(kind: bytes, key: Any, outcome: Outcome, target: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if outcome.ok and outcome.value is None:  # most replies: nothing to encode
            released = segments.take_releases()
            if kind == wire.RESULT and not released:
                raw_send(sock, wire.result_none(key))
            else:
                raw_send(sock, wire.head(kind, (key, wire.OK_NONE, released)))
            return
        try:
            enc = wire.encode(outcome)
        except Exception as exc:  # the user's return value does not pickle
            enc = wire.encode(crossing_failure(exc, rank, target, RESULT_NOT_SENT))
        desc, frames = wire.place(enc, pool)
        send_frames(sock, [wire.head(kind, (key, desc, segments.take_releases())), *frames])
        wire.done_placing(enc, pool)

    # ``async def`` calls wait for their coroutine (on the rank's event loop) in
    # these threads, so this loop takes the next calls meanwhile; their outcomes
    # come back through ``finished`` and are sent from here (the socket is this
    # thread's). While any runs, the loop wakes every few ms to send them.
    async_pool: ThreadPoolExecutor | None = None
    finished: queue.SimpleQueue[tuple[int, Outcome, str]] = queue.SimpleQueue()
    async_running = 0
    async_targets: dict[str, bool] = {}
    # Targets (as their UTF-8 bytes) that run as ``host.direct`` functions: plain
    # methods that a call without arguments reached on this thread before.
    direct: dict[bytes, Any] = {}
    cls_with_init: Any = None
    max_async = 1
    wait_ms = 1000

    def run_async_call(call_id: int, target: str, args: Any, kwargs: Any) -> None:
        try:
            outcome = host.run(target, args, kwargs)  # type: ignore[union-attr]
        except BaseException as exc:  # host.run captures user errors; this is a bug or a stop
            outcome = Outcome(False, RemoteFailure.capture(exc, rank, target))
        finished.put((call_id, outcome, target))

    next_trim = time.monotonic() + 1.0
    try:
        while True:
            while async_running and not finished.empty():
                done_id, done_outcome, done_target = finished.get()
                async_running -= 1
                reply(wire.RESULT, done_id, done_outcome, done_target)
                del done_outcome
            if wait_ms != (2 if async_running else 1000):
                wait_ms = 2 if async_running else 1000
                sock.setsockopt(zmq.RCVTIMEO, wait_ms)
            # The head as bytes (a no-op call is this one frame), the rest without a copy.
            try:
                first = sock.recv(copy=False)
                msg: list[Any] = [first.bytes]
            except zmq.Again:
                first, msg = None, []
            if (not msg and not async_running) or time.monotonic() >= next_trim:
                # Once a second, busy or idle: drop shared memory nobody uses any more.
                next_trim = time.monotonic() + 1.0
                if pool is not None:
                    pool.trim()
                if exporter is not None:
                    exporter.trim()
                segments.trim()
                shared_reads().trim()  # other ranks' exports this rank read, since removed
            if not msg:
                continue
            if first.more:
                msg += sock.recv_multipart(copy=False)
            first = None
            buf = msg[0]
            if (
                buf[:1] == wire.CALL_BARE
                and (call := direct.get(buf[9:])) is not None
                and len(msg) == 1
                and not control.cancelled
                and not control.stopping
            ):
                # The usual control call: a plain method without arguments this
                # rank ran before. Same steps as below, fewer of them per call.
                del msg
                call_id = int.from_bytes(buf[1:9], "little")
                control.running = call_id
                try:
                    outcome = call()
                    control.running = None
                except (Exception, CallInterrupted) as exc:
                    control.running = None
                    outcome = Outcome(False, RemoteFailure.capture(exc, rank, buf[9:].decode()))
                if outcome is RETURNED_NONE and not segments.released:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    raw_send(sock, wire.RESULT_NONE + buf[1:9])
                else:
                    reply(wire.RESULT, call_id, outcome, buf[9:].decode())
                del outcome
                continue
            kind = buf[:1]
            if kind != wire.CALL_BARE:
                kind, meta = wire.split_head(msg[0])
            if kind == wire.STOP:
                break
            if kind == wire.FREE:
                if pool is not None:
                    pool.release(meta)
                continue
            if kind == wire.INIT:
                descs, freed = meta
                if control.stopping:
                    continue
                if pool is not None:
                    pool.release(freed)
                try:
                    del msg[0]  # frames the decoder may drop as it joins them
                    (cls_with_init,) = wire.decode_objects(descs, msg, segments)
                    max_async = max_async_calls(cls_with_init.cls)
                    info = RankInfo.from_env()
                    if os.environ.get("PODIUM_TR_USE_GPU") == "1":
                        import torch

                        if torch.cuda.is_available():
                            torch.cuda.set_device(info.local_rank)
                    host, outcome = WorkerHost.start(info, cls_with_init)
                    if host is not None:
                        host.pin()  # this thread runs every call of the rank (but async ones)
                except Exception as exc:
                    outcome = Outcome(False, RemoteFailure.capture(exc, rank, "__init__"))
                del msg
                reply(wire.READY, None, outcome, "__init__")
                continue
            if kind == wire.CALL or kind == wire.CALL_BARE:
                if kind == wire.CALL_BARE:
                    call_id, target = wire.split_bare_call(msg[0])
                    descs = None
                else:
                    call_id, target, descs, arg_index, kw_index, freed = meta
                    if freed and pool is not None:
                        pool.release(freed)
                if control.skip(call_id):
                    # Cancelled before it started, or the group stops: the
                    # controller failed its futures already.
                    if not control.stopping:
                        why = CallInterrupted(f"call {call_id} was cancelled before it started")
                        reply(
                            wire.RESULT,
                            call_id,
                            Outcome(False, RemoteFailure.capture(why, rank, target)),
                            target,
                        )
                    continue
                control.running = call_id
                try:
                    if descs is None:  # CALL_BARE
                        del msg
                        args, kwargs = (), {}
                    else:
                        del msg[0]  # frames the decoder may drop as it joins them
                        try:
                            objs = wire.decode_objects(descs, msg, segments)
                        except Exception as exc:
                            objs = None
                            outcome = crossing_failure(exc, rank, target, ARGUMENT_NOT_LOADED)
                        del msg
                        if objs is None:
                            control.running = None
                            reply(wire.RESULT, call_id, outcome, target)
                            continue
                        args = tuple(objs[i] for i in arg_index)
                        kwargs = {k: objs[i] for k, i in kw_index.items()}
                        del objs
                    if host is None:
                        raise RuntimeError("the worker was not constructed")
                    is_async = async_targets.get(target)
                    if is_async is None:
                        is_async = async_targets[target] = is_async_target(cls_with_init, target)
                    if is_async:
                        # A deadline does not interrupt it: it does not run on this thread.
                        control.running = None
                        if async_pool is None:
                            async_pool = ThreadPoolExecutor(
                                max_async, thread_name_prefix="podium-async"
                            )
                        async_running += 1
                        async_pool.submit(run_async_call, call_id, target, args, kwargs)
                        args = kwargs = None  # type: ignore[assignment]
                        continue
                    if descs is None:
                        outcome = host.run_bare(target)
                    else:
                        outcome = host.run(target, args, kwargs)
                    control.running = None
                    if descs is None and (call := host.direct(target)) is not None:
                        direct[target.encode()] = call  # its next calls take the path above
                except (Exception, CallInterrupted) as exc:
                    control.running = None
                    outcome = Outcome(False, RemoteFailure.capture(exc, rank, target))
                # Drop the inputs before replying, so their segments are released with it.
                args = kwargs = None  # type: ignore[assignment]
                reply(wire.RESULT, call_id, outcome, target)
                del outcome
    finally:
        if host is not None:
            failure = host.close()  # cancels the async calls still awaiting
            if async_pool is not None:
                async_pool.shutdown(wait=False)
            if failure is not None:
                sys.stderr.write(
                    f"podium: the worker's shutdown() hook on rank {rank} failed:\n{failure.traceback}"
                )
        left = release_process_groups()  # before Python's teardown: see there
        if left is not None:
            sys.stderr.write(f"podium: rank {rank} could not destroy its process group: {left}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        sock.close(linger=1000)
        ctx.term()
        if pool is not None:
            pool.close()
        if exporter is not None:
            exporter.close()


def _exporter(
    rank: int, keys: tuple[bytes, bytes], reader: tuple[bytes, bytes], *, max_free: int, max_idle: float
) -> Any:
    """Where this rank keeps ``output="ref"`` shards: segments of this rank (removed with it),
    served to other hosts by a shard server started with the first export; None without /dev/shm."""
    from podium.backends.torchrun import shardserver
    from podium.backends.torchrun.channel import set_reader_keys
    from podium.backends.torchrun.dataplane import ShmExporter
    from podium.backends.torchrun.shm import shm_available
    from podium.core.dataplane import set_exporter

    set_reader_keys(*reader)
    if not shm_available():
        return None  # outputs by value: the controller holds them
    bind = os.environ.get("PODIUM_TR_DATA_HOST", "")

    def serve(lookup: Any) -> Any:
        from podium.backends.torchrun.schedulers import reachable_host

        host = bind or reachable_host()
        return shardserver.ShardServer(
            keys=keys,
            reader_public=reader[0],
            bind_host=host,
            advertise_host=reachable_host() if host in ("0.0.0.0", "*", "::") else host,
            lookup=lookup,
        )

    exporter = ShmExporter(_shm_prefix(f"w{rank}"), serve, max_free=max_free, max_idle=max_idle)
    set_exporter(exporter)
    return exporter


# -- the supervisor ----------------------------------------------------------------


class _Supervisor:
    def __init__(
        self,
        rank: int,
        child: int,
        out_fd: int,
        err_fd: int,
        ctl_fd: int,
        keys: tuple[bytes, bytes],
    ) -> None:
        import zmq

        self.zmq = zmq
        self.rank = rank
        self.child = child
        self.ctl = ctl_fd
        self.pgid = child  # the worker leads its own process group
        self.fds = {out_fd: (b"1", 1), err_fd: (b"2", 2)}
        self.partial: dict[int, bytes] = {out_fd: b"", err_fd: b""}
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self.beat = float(os.environ.get("PODIUM_TR_BEAT", "0.5"))
        self.orphan_after = float(os.environ.get("PODIUM_TR_ORPHAN_TIMEOUT", "8"))
        # On the controller's host, whether it is alive is a fact (its pid);
        # elsewhere the connection's ZMTP heartbeats tell.
        self.controller = _controller_process()
        self.ctx, self.sock, self.monitor = _connect(
            b"s%d" % rank,
            keys,
            0.0 if self.controller else max(self.orphan_after, 2.0),
            monitor_events=zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
        )
        self.linked = False  # the connection to the controller is up
        self.parent = os.getppid()
        self.terminating_at: float | None = None
        self.quit_by: float | None = None  # the group stops: the worker must be gone by then
        self.stopped_since: float | None = None

    def send(self, *frames: bytes) -> None:
        try:
            self.sock.send_multipart(list(frames), self.zmq.NOBLOCK)
        except self.zmq.ZMQError:
            pass

    def read(self, fd: int) -> bool | None:
        """Forward what ``fd`` holds: True if it had data, None if none now, False at its end."""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            del self.fds[fd]
            return False
        stream, out = self.fds[fd]
        # Keep torchrun's/torchx's own logs complete too.
        try:
            os.write(out, data)
        except OSError:
            pass
        self.send(_LOG + stream, data)
        text = self.partial[fd] + data
        *lines, self.partial[fd] = text.split(b"\n")
        for line in lines:
            self.tail.append(line.decode(errors="replace"))
        return True

    def drain(self, until: float) -> None:
        """Forward what the worker wrote before it ended.

        Bounded: a process the worker started may still hold its stdout
        (DataLoader workers, ``subprocess.Popen``); its later output is not waited for.
        """
        for fd in list(self.fds):
            while fd in self.fds and self.read(fd) and time.monotonic() < until:
                pass
        for rest in self.partial.values():
            if rest:
                self.tail.append(rest.decode(errors="replace"))

    def tell_worker(self, line: bytes) -> None:
        """Pass a request to the worker (see :class:`_Control`) and make it look."""
        try:
            os.write(self.ctl, line + b"\n")
            os.kill(self.child, _CONTROL_SIGNAL)
        except OSError:
            pass

    def reap_leftovers(self) -> None:
        """Kill what the ended worker left running in its process group: no orphans."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except OSError:
            pass  # none left

    def kill_child(self, why: str) -> int | None:
        """Stop the worker (SIGTERM, then SIGKILL); its wait status, if it was reaped."""
        sys.stderr.write(f"[podium supervisor rank {self.rank}] {why}; stopping the worker\n")
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.kill(self.child, sig)
                os.kill(
                    self.child, signal.SIGCONT
                )  # a stopped process acts on SIGTERM only once continued
            except ProcessLookupError:
                return None
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                pid, status = os.waitpid(self.child, os.WNOHANG)
                if pid:
                    self.child = 0
                    return status
                time.sleep(0.05)
        return None

    def read_link(self) -> None:
        """Follow the connection to the controller: up after a handshake, down after a disconnect."""
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self.monitor, self.zmq.NOBLOCK)
            except self.zmq.ZMQError:
                return
            self.linked = event["event"] == self.zmq.EVENT_HANDSHAKE_SUCCEEDED

    def controller_gone(self, now: float, last_ping: float) -> str | None:
        """Why the controller is taken for gone, or None while it may still come back.

        A paused controller (SIGSTOP, a long call holding its GIL) is not gone:
        on its host its pid is checked; elsewhere its connection stays up as
        long as its ZeroMQ I/O thread answers heartbeats.
        """
        if self.controller is not None and not _process_alive(*self.controller):
            return f"the controller (pid {self.controller[0]}) has exited"
        if now - last_ping > self.orphan_after and not self.linked:
            return (
                f"no word from the controller for {self.orphan_after:g} s and no connection to it"
            )
        return None

    def watch_stopped(self, now: float) -> None:
        """Tell the controller when the worker is stopped (state T), each beat while it lasts."""
        if _process_state(self.child) == "T":
            if self.stopped_since is None:
                self.stopped_since = now
            self.send(_STALL + b"%d" % int(now - self.stopped_since))
        else:
            self.stopped_since = None

    def on_message(self, msg: list[bytes]) -> None:
        kind = msg[0][:1]
        if kind == _CANCEL:
            self.tell_worker(msg[0])
        elif kind == _QUIT:
            self.tell_worker(_QUIT)
            try:
                grace = float(msg[0][1:])
            except ValueError:
                grace = 10.0
            if self.quit_by is None:
                self.quit_by = time.monotonic() + grace

    def run(self) -> int:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        for fd in self.fds:
            os.set_blocking(fd, False)
            poller.register(fd, zmq.POLLIN)
        last_ping = time.monotonic()
        next_beat = 0.0
        status: int | None = None
        cause = ""

        def on_term(signum: int, _frame: Any) -> None:
            # torchrun tears the node down with SIGTERM: pass it on and wait for the worker.
            if self.terminating_at is None:
                self.terminating_at = time.monotonic()
            try:
                os.kill(self.child, signum)
                os.kill(self.child, signal.SIGCONT)
            except ProcessLookupError:
                pass

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        while status is None:
            now = time.monotonic()
            if now >= next_beat:
                self.send(_BEAT)
                self.watch_stopped(now)
                next_beat = now + self.beat
            try:
                events = dict(poller.poll(int(self.beat * 1000)))
            except zmq.ZMQError:
                events = {}
            for fd in list(self.fds):
                if fd in events and self.read(fd) is False:
                    poller.unregister(fd)
            if self.sock in events:
                while True:
                    try:
                        msg = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    last_ping = time.monotonic()
                    if msg[0][:1] != _PING:
                        self.on_message(msg)
            if self.monitor in events:
                self.read_link()
            pid, status_raw = os.waitpid(self.child, os.WNOHANG)
            if pid:
                status = status_raw
                break
            now = time.monotonic()
            gone = self.controller_gone(now, last_ping)
            if gone is not None:
                self.kill_child(gone)
                self.reap_leftovers()
                self.cleanup(controller_gone=True)
                return 0
            if os.getppid() != self.parent:
                cause = f"torchrun's agent (pid {self.parent}) is gone, so the worker was stopped"
                status = self.kill_child("torchrun's agent is gone")
                break
            if self.terminating_at is not None and now - self.terminating_at > 5.0:
                status = self.kill_child("the worker ignored SIGTERM for 5 s")
                break
            if self.quit_by is not None and now > self.quit_by:
                status = self.kill_child(
                    "the worker did not stop in time after the group's shutdown"
                )
                break
        # Report first (a bounded read of the last output goes with it), clean up after.
        self.drain(time.monotonic() + 0.5)
        self.reap_leftovers()
        code = os.waitstatus_to_exitcode(status) if status is not None else -int(signal.SIGKILL)
        info = {
            "exit_code": code if code >= 0 else None,
            "signal": -code if code < 0 else None,
            "tail": list(self.tail),
            # Stopped by torchrun (another rank of this node failed, or the job
            # was cancelled): a consequence, not the cause, of the group's end.
            "torn_down": self.terminating_at is not None and not cause,
            "cause": cause,
        }
        self.send(_EXIT + msgpack.packb(info, use_bin_type=True))
        self.cleanup(controller_gone=False)
        return code if code >= 0 else 128 - code

    def cleanup(self, *, controller_gone: bool) -> None:
        _unlink_prefix(_shm_prefix(f"w{self.rank}"))
        if controller_gone and self.rank == 0:
            # Nobody else is left to remove the controller's segments, nor the
            # private directory of its Unix socket.
            _unlink_prefix(_shm_prefix("c"))
            ipc = os.environ.get("PODIUM_TR_IPC", "")
            if ipc.startswith("ipc://") and _shm_probe_ok():  # same host as the controller
                path = ipc[len("ipc://") :]
                if os.path.basename(os.path.dirname(path)).startswith("podium-zmq-"):
                    for remove, leftover in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
                        try:
                            remove(leftover)
                        except OSError:
                            pass
            _unlink_prefix(_shm_prefix("probe")[:-1])  # last: the check above reads it
        self.monitor.close(linger=0)
        self.sock.close(linger=500)
        self.ctx.term()


def main() -> None:
    rank = int(_env("RANK"))
    _env("PODIUM_TR_ADDR")
    keys, reader = _read_keys(rank)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ctl_r, ctl_w = os.pipe()
    supervisor = os.getpid()
    child = os.fork()
    if child == 0:
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in (out_r, out_w, err_r, err_w, ctl_w):
            os.close(fd)
        os.set_blocking(ctl_r, False)
        _control.fd = ctl_r
        signal.signal(_CONTROL_SIGNAL, _control.on_signal)
        _die_with_parent(supervisor)
        # Its own process group, so that what it starts and leaves behind
        # (a subprocess, a DataLoader worker) goes with it (see _Supervisor.reap_leftovers).
        os.setpgid(0, 0)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        code = 0
        try:
            _worker_main(rank, keys, reader)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        # A normal interpreter exit, so that the user's atexit handlers run
        # (the supervisor bounds how long it may take).
        sys.exit(code)
    try:
        os.setpgid(child, child)  # as the child does: whichever runs first
    except OSError:
        pass
    for fd in (out_w, err_w, ctl_r):
        os.close(fd)
    sys.exit(_Supervisor(rank, child, out_r, err_r, ctl_w, keys).run())


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its supervisor dies (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        os._exit(1)


if __name__ == "__main__":
    main()
