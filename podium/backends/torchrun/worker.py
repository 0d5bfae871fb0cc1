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
  milliseconds. When the controller stops answering (even after a
  ``SIGKILL``), the supervisor kills the worker and exits.

torchrun loads this file by its path, not as ``podium.backends.torchrun.worker``:
importing a module of the package imports ``podium`` (torch, tensordict),
~2 s of CPU that the supervisor never needs; only the worker imports it, after
the fork, with ``torch._dynamo`` deferred (:mod:`.lazy_dynamo`). So nothing
here imports podium at module level. (``python -m`` still works.)

Everything arrives through the environment (``PODIUM_TR_*``, set by the
controller) and torchrun (``RANK``, ``LOCAL_RANK``, ... ``MASTER_PORT``).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from collections import deque
from typing import Any

__all__ = ["main"]

_TAIL_LINES = 40
# The supervisor's message kinds (wire.BEAT, wire.LOG, wire.EXIT): spelled out
# here because importing wire pulls in torch, and the supervisor stays small.
_BEAT, _LOG, _EXIT = b"B", b"L", b"X"


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        sys.stderr.write(
            f"podium torchrun worker: {name} is not set. This entry point is started by "
            "podium's torchrun backend (WorkerGroup(..., backend='torchrun')), not by hand.\n"
        )
        sys.exit(2)
    return value


def _connect(identity: bytes) -> tuple[Any, Any]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 2000
    sock.sndhwm = 0
    sock.rcvhwm = 0
    sock.identity = identity
    sock.curve_serverkey = _env("PODIUM_TR_SERVER_KEY").encode()
    sock.curve_publickey = _env("PODIUM_TR_CLIENT_KEY").encode()
    sock.curve_secretkey = _env("PODIUM_TR_CLIENT_SECRET").encode()
    sock.connect(_address())
    return ctx, sock


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


def _worker_main(rank: int) -> None:
    import socket as _socket

    import zmq

    _sibling("lazy_dynamo").install()  # before anything imports torch

    from podium.backends.torchrun import wire
    from podium.backends.torchrun.channel import send_frames
    from podium.backends.torchrun.shm import (
        MAX_FREE_BYTES,
        MAX_IDLE_S,
        SegmentMap,
        SegmentPool,
        tune_malloc,
    )
    from podium.core.host import Outcome, RemoteFailure, WorkerHost
    from podium.core.worker import RankInfo

    # This process is podium's own: keep large freed blocks in the heap so
    # that a method making a large tensor per call (``x * 2`` on a 16 MiB
    # shard) reuses mapped pages instead of page-faulting a fresh mmap each
    # time (see shm.tune_malloc; costs RSS, which stays at its high-water mark).
    tune_malloc()
    ctx, sock = _connect(b"w%d" % rank)
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
    hello = {"rank": rank, "pid": os.getpid(), "host": _socket.gethostname(), "shm": shm_ok}
    send_frames(sock, [wire.head(wire.HELLO, hello)])
    host: WorkerHost | None = None
    rcvmore = int(zmq.RCVMORE)  # sock.get(rcvmore) is ~3x cheaper than sock.rcvmore

    def reply(kind: bytes, key: Any, outcome: Outcome, target: str) -> None:
        try:
            enc = wire.encode(outcome)
        except Exception as exc:  # the user's return value does not pickle
            enc = wire.encode(Outcome(False, RemoteFailure.capture(exc, rank, target)))
        desc, frames = wire.place(enc, pool)
        sys.stdout.flush()
        sys.stderr.flush()
        send_frames(sock, [wire.head(kind, (key, desc, segments.take_releases())), *frames])
        wire.done_placing(enc, pool)

    next_trim = time.monotonic() + 1.0
    try:
        while True:
            # The head as bytes (a no-op call is this one frame), the rest without a copy.
            try:
                msg: list[Any] = [sock.recv()]
            except zmq.Again:
                msg = []
            if not msg or time.monotonic() >= next_trim:
                # Once a second, busy or idle: drop shared memory nobody uses any more.
                next_trim = time.monotonic() + 1.0
                if pool is not None:
                    pool.trim()
                segments.trim()
                if not msg:
                    continue
            if sock.get(rcvmore):
                msg += sock.recv_multipart(copy=False)
            kind, meta = wire.split_head(msg[0])
            if kind == wire.STOP:
                break
            if kind == wire.FREE:
                if pool is not None:
                    pool.release(meta)
                continue
            if kind == wire.INIT:
                descs, freed = meta
                if pool is not None:
                    pool.release(freed)
                try:
                    del msg[0]  # frames the decoder may drop as it joins them
                    (cls_with_init,) = wire.decode_objects(descs, msg, segments)
                    info = RankInfo.from_env()
                    if os.environ.get("PODIUM_TR_USE_GPU") == "1":
                        import torch

                        if torch.cuda.is_available():
                            torch.cuda.set_device(info.local_rank)
                    host, outcome = WorkerHost.start(info, cls_with_init)
                except Exception as exc:
                    outcome = Outcome(False, RemoteFailure.capture(exc, rank, "__init__"))
                del msg
                reply(wire.READY, None, outcome, "__init__")
                continue
            if kind == wire.CALL:
                call_id, target, descs, arg_index, kw_index, freed = meta
                if pool is not None:
                    pool.release(freed)
                try:
                    del msg[0]  # frames the decoder may drop as it joins them
                    objs = wire.decode_objects(descs, msg, segments)
                    del msg
                    args = tuple(objs[i] for i in arg_index)
                    kwargs = {k: objs[i] for k, i in kw_index.items()}
                    del objs
                    if host is None:
                        raise RuntimeError("the worker was not constructed")
                    outcome = host.run(target, args, kwargs)
                except Exception as exc:
                    outcome = Outcome(False, RemoteFailure.capture(exc, rank, target))
                # Drop the inputs before replying, so their segments are released with it.
                args = kwargs = None  # type: ignore[assignment]
                reply(wire.RESULT, call_id, outcome, target)
                del outcome
    finally:
        if host is not None:
            host.close()
        sys.stdout.flush()
        sys.stderr.flush()
        sock.close(linger=1000)
        ctx.term()
        if pool is not None:
            pool.close()


# -- the supervisor ----------------------------------------------------------------


class _Supervisor:
    def __init__(self, rank: int, child: int, out_fd: int, err_fd: int) -> None:
        import zmq

        self.zmq = zmq
        self.rank = rank
        self.child = child
        self.fds = {out_fd: (b"1", 1), err_fd: (b"2", 2)}
        self.partial: dict[int, bytes] = {out_fd: b"", err_fd: b""}
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self.ctx, self.sock = _connect(b"s%d" % rank)
        self.beat = float(os.environ.get("PODIUM_TR_BEAT", "0.5"))
        self.orphan_after = float(os.environ.get("PODIUM_TR_ORPHAN_TIMEOUT", "8"))
        self.parent = os.getppid()
        self.terminating_at: float | None = None

    def send(self, *frames: bytes) -> None:
        try:
            self.sock.send_multipart(list(frames), self.zmq.NOBLOCK)
        except self.zmq.ZMQError:
            pass

    def read(self, fd: int) -> bool:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
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

    def drain(self) -> None:
        for fd in list(self.fds):
            while fd in self.fds and self.read(fd):
                pass
        for rest in self.partial.values():
            if rest:
                self.tail.append(rest.decode(errors="replace"))

    def kill_child(self, why: str) -> None:
        sys.stderr.write(f"[podium supervisor rank {self.rank}] {why}; stopping the worker\n")
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.kill(self.child, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                pid, _ = os.waitpid(self.child, os.WNOHANG)
                if pid:
                    self.child = 0
                    return
                time.sleep(0.05)

    def run(self) -> int:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for fd in self.fds:
            os.set_blocking(fd, False)
            poller.register(fd, zmq.POLLIN)
        last_ping = time.monotonic()
        next_beat = 0.0
        status: int | None = None

        def on_term(signum: int, _frame: Any) -> None:
            # torchrun tears the node down with SIGTERM: pass it on and wait for the worker.
            if self.terminating_at is None:
                self.terminating_at = time.monotonic()
            try:
                os.kill(self.child, signum)
            except ProcessLookupError:
                pass

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        while status is None:
            now = time.monotonic()
            if now >= next_beat:
                self.send(_BEAT)
                next_beat = now + self.beat
            try:
                events = dict(poller.poll(int(self.beat * 1000)))
            except zmq.ZMQError:
                events = {}
            for fd in list(self.fds):
                if fd in events and not self.read(fd):
                    poller.unregister(fd)
            if self.sock in events:
                while True:
                    try:
                        self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    last_ping = time.monotonic()
            pid, status_raw = os.waitpid(self.child, os.WNOHANG)
            if pid:
                status = status_raw
                break
            now = time.monotonic()
            if now - last_ping > self.orphan_after:
                self.kill_child(f"no word from the controller for {self.orphan_after:g} s")
                self.cleanup(controller_gone=True)
                return 0
            if os.getppid() != self.parent:
                self.kill_child("torchrun's agent is gone")
                self.cleanup(controller_gone=False)
                return 1
            if self.terminating_at is not None and now - self.terminating_at > 5.0:
                self.kill_child("the worker ignored SIGTERM for 5 s")
                self.cleanup(controller_gone=False)
                return 1
        self.drain()
        code = os.waitstatus_to_exitcode(status)
        info = {
            "exit_code": code if code >= 0 else None,
            "signal": -code if code < 0 else None,
            "tail": list(self.tail),
        }
        self.send(_EXIT + pickle.dumps(info, protocol=5))
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
        self.sock.close(linger=500)
        self.ctx.term()


def main() -> None:
    rank = int(_env("RANK"))
    _env("PODIUM_TR_ADDR")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    supervisor = os.getpid()
    child = os.fork()
    if child == 0:
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        _die_with_parent(supervisor)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        code = 0
        try:
            _worker_main(rank)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    os.close(out_w)
    os.close(err_w)
    sys.exit(_Supervisor(rank, child, out_r, err_r).run())


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
