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

        # Callers wake the I/O thread through this pair after queueing a message.
        wake_addr = f"inproc://podium-wake-{id(self)}"
        self._wake_recv = self.ctx.socket(zmq.PULL)
        self._wake_recv.bind(wake_addr)
        self._wake_send = self.ctx.socket(zmq.PUSH)
        self._wake_send.linger = 0
        self._wake_send.connect(wake_addr)
        self._wake_lock = threading.Lock()

        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called from any thread ---------------------------------------------

    def send(self, identity: bytes, frames: list[Any]) -> None:
        self._outbox.append((identity, frames))
        with self._wake_lock:
            if not self._closing.is_set():
                self._wake_send.send(b"", zmq.NOBLOCK)

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued messages, stop the I/O thread, close every socket and free the port."""
        if self._closing.is_set():
            return
        with self._wake_lock:
            self._closing.set()
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        for sock in (self._wake_send, self._wake_recv, self._monitor, self._router, self._zap):
            sock.close(linger=0)
        self.ctx.term()

    # -- the I/O thread -------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_tick = time.monotonic()
        while True:
            self._flush_outbox()
            if self._closing.is_set():
                return
            timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
            try:
                ready = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                return
            if self._wake_recv in ready:
                while True:
                    try:
                        self._wake_recv.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._router in ready:
                self._drain_router()
            if self._zap in ready:
                self._answer_zap()
            if self._monitor in ready:
                self._read_monitor()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self._tick
                self._safely(self._on_tick, now)

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
