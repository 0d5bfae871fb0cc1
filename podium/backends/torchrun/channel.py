"""The controller's end of a group's control channel.

One ZeroMQ ROUTER socket per group, bound to loopback unless a multi-node
address is configured, reached by one DEALER per worker and one per worker's
supervisor. The socket is a CURVE server with keys made for this group; a
ZAP handler (answered on this channel's own I/O thread) admits only the
group's client key, so a peer without the keys never gets a message to the
group -- its attempt is logged and the group keeps working.

A socket belongs to one thread, so one I/O thread owns every socket here:
callers hand it outgoing messages (:meth:`ControlChannel.send`), and it hands
incoming ones to the ``on_message`` callback and calls ``on_tick`` about
every ``tick`` seconds (heartbeats, deadlines).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils import z85

from podium.backends.torchrun.wire import is_zero_copy

__all__ = ["ControlChannel", "CurveKeys"]

log = logging.getLogger("podium.torchrun")

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"

OnMessage = Callable[[bytes, bytes, list[Any]], None]
OnTick = Callable[[float], None]


class CurveKeys:
    """The keys of one group: the controller's pair and the one pair its workers share."""

    def __init__(self) -> None:
        self.server_public, self.server_secret = zmq.curve_keypair()
        self.client_public, self.client_secret = zmq.curve_keypair()

    def worker_env(self) -> dict[str, str]:
        return {
            "PODIUM_TR_SERVER_KEY": self.server_public.decode(),
            "PODIUM_TR_CLIENT_KEY": self.client_public.decode(),
            "PODIUM_TR_CLIENT_SECRET": self.client_secret.decode(),
        }


def send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send a multipart message; large frames go without a copy."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        flags = zmq.SNDMORE if i < last else 0
        sock.send(frame, flags, copy=not is_zero_copy(frame))


def _readable(sock: zmq.Socket[Any]) -> bool:
    """Whether ``sock`` has a message now (also re-arms its descriptor's readiness edge)."""
    return bool(int(sock.get(zmq.EVENTS)) & zmq.POLLIN)


class ControlChannel:
    """A CURVE ROUTER socket and the I/O thread that serves it."""

    def __init__(
        self,
        *,
        bind_host: str,
        advertise_host: str,
        on_message: OnMessage,
        on_tick: OnTick,
        tick: float = 0.25,
        name: str = "podium-torchrun",
    ) -> None:
        self.keys = CurveKeys()
        self._client_key = z85.decode(self.keys.client_public)
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick = tick
        self._outbox: deque[tuple[bytes, list[Any]]] = deque()
        self._closing = threading.Event()
        self.rejected = 0  # connection attempts refused (unknown key or no CURVE)

        self.ctx = zmq.Context()
        # The ZAP handler must exist before the first handshake.
        self._zap = self.ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(_ZAP_ENDPOINT)

        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        self._router.sndhwm = 0
        self._router.rcvhwm = 0
        self._router.router_mandatory = True
        self._router.curve_server = True
        self._router.curve_secretkey = self.keys.server_secret
        self._router.curve_publickey = self.keys.server_public
        self._router.zap_domain = b"podium"
        self._monitor = self._router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        self.port = port
        self.address = f"tcp://{advertise_host}:{port}"

        # Whoever holds ``_io`` may use the sockets: the I/O thread, a caller
        # sending, or a caller waiting for its results (which then serves the
        # channel itself, saving two thread hand-offs per call). Nobody blocks
        # while holding it: waiting is a select() on the sockets' descriptors.
        self._io = threading.Lock()
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._fds = [self._router.FD, self._zap.FD, self._monitor.FD]
        self._next_tick = time.monotonic()
        self._closed = False

        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called from any thread ---------------------------------------------

    def send(self, identity: bytes, frames: list[Any]) -> None:
        self.send_many([(identity, frames)])

    def send_many(self, messages: list[tuple[bytes, list[Any]]]) -> None:
        self._outbox.extend(messages)
        if self._io.acquire(blocking=False):
            try:
                if not self._closed:
                    self._flush_outbox()
                    # Sending may consume the socket's readiness edge: tell waiters to look.
                    if _readable(self._router):
                        self._wake()
            finally:
                self._io.release()
        else:
            self._wake()

    def wait(self, done: threading.Event, timeout: float | None) -> bool:
        """Wait for ``done``, serving the channel from this thread meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._waiters_lock:
            self._waiters += 1
        try:
            while not done.is_set():
                served = False
                if self._io.acquire(blocking=False):
                    try:
                        if self._closed:
                            return done.wait(
                                0 if deadline is None else max(0.0, deadline - time.monotonic())
                            )
                        self._serve()
                        served = True
                    finally:
                        self._io.release()
                    if done.is_set():
                        return True
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                # After serving, the descriptors are re-armed; otherwise someone
                # else is serving and may resolve us: look again soon.
                nap = max(0.0, self._next_tick - now) if served else 0.002
                if deadline is not None:
                    nap = min(nap, deadline - now)
                self._select(self._fds, nap)
            return True
        finally:
            with self._waiters_lock:
                self._waiters -= 1

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued messages, stop the I/O thread, close every socket and free the port."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._io:
            self._closed = True
            try:
                self._flush_outbox()
            except zmq.ZMQError:
                pass
            for sock in (self._monitor, self._router, self._zap):
                sock.close(linger=0)
            self.ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- serving ----------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    def _select(self, fds: list[int], timeout: float) -> None:
        try:
            ready, _, _ = select.select([*fds, self._wake_r], [], [], max(0.0, timeout))
        except (OSError, ValueError):
            return
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except (BlockingIOError, OSError):
                pass

    def _serve(self) -> None:
        """Do everything pending (caller holds ``_io``); returns with the descriptors re-armed."""
        while True:
            busy = False
            if self._outbox:
                self._flush_outbox()
            if _readable(self._router):
                self._drain_router()
                busy = True
            if _readable(self._zap):
                self._answer_zap()
                busy = True
            if _readable(self._monitor):
                self._read_monitor()
                busy = True
            now = time.monotonic()
            if now >= self._next_tick:
                self._next_tick = now + self._tick
                self._safely(self._on_tick, now)
                busy = True
            if not busy and not self._outbox:
                return

    def _loop(self) -> None:
        while not self._closing.is_set():
            fds: list[int] = []
            nap = 0.005  # a caller is waiting and serves the sockets itself
            if self._waiters == 0:
                fds = self._fds
                nap = 0.002  # a sender holds the sockets for a moment
                if self._io.acquire(blocking=False):
                    try:
                        if self._closed:
                            return
                        self._serve()
                    finally:
                        self._io.release()
                    nap = max(0.0, self._next_tick - time.monotonic())
            self._select(fds, nap)

    def _flush_outbox(self) -> None:
        while self._outbox:
            identity, frames = self._outbox.popleft()
            try:
                send_frames(self._router, [identity, *frames])
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the peer is gone; its supervisor's report or a
                # missed heartbeat turns that into an error at the caller.
                log.debug("could not send to %r: %s", identity, exc)

    def _drain_router(self) -> None:
        for _ in range(1000):
            try:
                msg = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(msg) < 2:
                continue
            self._safely(self._on_message, msg[0].bytes, msg[1].bytes, msg[2:])

    def _answer_zap(self) -> None:
        try:
            req = self._zap.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials...
        version, request_id, _domain, address, _identity, mechanism = req[:6]
        credentials = req[6:]
        ok = mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] == self._client_key
        if ok:
            self._zap.send_multipart([version, request_id, b"200", b"OK", b"worker", b""])
        else:
            self.rejected += 1
            log.warning(
                "podium torchrun: refused a connection from %s (mechanism %s, key not this group's); "
                "it cannot reach any worker",
                address.decode(errors="replace"),
                mechanism.decode(errors="replace"),
            )
            self._zap.send_multipart([version, request_id, b"400", b"unknown key", b"", b""])

    def _read_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            # Failed handshakes (no CURVE, wrong server key, garbage bytes) never
            # reach ZAP; the monitor is where they show.
            if event["event"] in (
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            ):
                self.rejected += 1
                log.warning(
                    "podium torchrun: refused a connection to %s that failed the CURVE handshake "
                    "(no keys or not a podium worker); nothing it sent was read",
                    event.get("endpoint", b"").decode(errors="replace")
                    if isinstance(event.get("endpoint"), bytes)
                    else event.get("endpoint"),
                )

    def _safely(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a bug in a handler must not kill the I/O thread
            log.exception("podium torchrun: error in the control channel's handler")
