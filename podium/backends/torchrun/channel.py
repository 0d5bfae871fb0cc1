"""The controller's end of a group's control channel.

One ZeroMQ ROUTER socket per group, bound to loopback unless a multi-node
address is configured (and to a Unix socket in a private directory, which
workers on this host use), reached by one DEALER per worker and one per
worker's supervisor. The socket is a CURVE server with keys made for this
group; a ZAP handler (answered by whichever thread serves the channel)
admits only the group's client keys, so a peer without the keys never gets a
message to the group -- its attempt is logged (at most once a minute, with a
count: anyone can knock) and the group keeps working.

Each rank has its own client key pair, bound to that rank's identities
(``w<rank>`` for its worker, ``s<rank>`` for its supervisor): the ZAP handler
stamps each connection with the rank its key belongs to (ZAP's User-Id; the
identity a ZAP request carries is the server socket's own, not the peer's),
and every message whose identity is not of that rank is dropped. So one
rank's key cannot speak for another rank.

A ZeroMQ socket must be used by one thread at a time: whoever holds the
channel's ``_io`` lock uses the sockets. Incoming messages go to the
``on_message`` callback, and ``on_tick`` runs about every ``tick`` seconds
(heartbeats, deadlines), on whichever thread holds the lock.

Who holds it is chosen for latency. A call on a small host is a handful of
context switches; a second Python thread that wakes during a call costs far
more (it must win the GIL, which can take up to the 5 ms switch interval).
So:

- a caller **sends** directly from its own thread (:meth:`send_many`);
- a caller **waiting** for results serves the sockets itself
  (:meth:`wait`): one ``zmq_poll`` that returns when a reply arrives, the
  reply handled on the same thread -- no hand-off to another thread;
- the **I/O thread** serves only when no caller has been active for
  ``_QUIET`` seconds or a tick is due (idle groups: heartbeats, forwarded
  output, a worker's exit report). While a caller is active it sleeps and
  touches neither the sockets nor the GIL; it yields the lock to a waiter
  as soon as one appears (woken through a pipe).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import zmq
from zmq.utils import z85

from podium.backends.torchrun.wire import ZERO_COPY_MIN, is_zero_copy

__all__ = ["ControlChannel", "CurveKeys", "reader_keys", "set_reader_keys"]

log = logging.getLogger("podium.torchrun")

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
# pyzmq's ``Socket.send`` is Python around the compiled send, for the
# ``routing_id`` and ``group`` of draft socket types that podium does not use;
# the per-call paths call the compiled one (same arguments: data, flags, copy).
raw_send = zmq.backend.Socket.send
# How long after a caller's last send or wait the I/O thread stays away.
_QUIET = 0.05
# Refused connections are logged at most this often (with a count of the rest).
_WARN_EVERY = 60.0
# The longest a tick reads queued messages before it judges heartbeats.
_DRAIN_MAX = 0.5
# The most messages read after one poll before the other sockets get a look.
_RECV_BATCH = 64

OnMessage = Callable[[bytes, bytes, list[Any]], None]
OnTick = Callable[[float], None]


_reader: tuple[bytes, bytes] | None = None
_reader_lock = threading.Lock()


def reader_keys() -> tuple[bytes, bytes]:
    """This controller's *reader* key pair ``(public, secret)``, made once per controller process.

    Every rank of every group this controller starts gets it in its key file,
    next to its own pair; shard servers admit only it (see :mod:`.shardserver`).
    A worker process holds its controller's pair instead (:func:`set_reader_keys`).
    """
    global _reader
    with _reader_lock:
        if _reader is None:
            _reader = zmq.curve_keypair()
        return _reader


def set_reader_keys(public: bytes, secret: bytes) -> None:
    """Use the reader pair the controller gave this worker (from its key file)."""
    global _reader
    with _reader_lock:
        _reader = (public, secret)


class CurveKeys:
    """The keys of one group: the controller's pair and one client pair per rank.

    Secrets never travel in an environment (which ``/proc``, job scripts and
    schedulers show): :meth:`write_files` leaves each rank's pair in a file
    that only this user can read, which the rank's supervisor reads and
    deletes (see the worker module).
    """

    def __init__(self, world_size: int) -> None:
        self.server_public, self.server_secret = zmq.curve_keypair()
        self.clients = [zmq.curve_keypair() for _ in range(world_size)]

    def worker_env(self) -> dict[str, str]:
        """What every rank may know: the controller's public key."""
        return {"PODIUM_TR_SERVER_KEY": self.server_public.decode()}

    def write_files(self, directory: str) -> None:
        """One file per rank, ``<directory>/rank-<rank>`` (0600): its public and secret key,
        then the controller's reader pair (:func:`reader_keys`)."""
        reader_public, reader_secret = reader_keys()
        for rank, (public, secret) in enumerate(self.clients):
            path = os.path.join(directory, f"rank-{rank}")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(path, flags, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(b"\n".join((public, secret, reader_public, reader_secret)) + b"\n")


class _RateLimitedWarning:
    """A warning logged at most once per ``every`` seconds, with how many were held back."""

    def __init__(self, every: float = _WARN_EVERY) -> None:
        self.every = every
        self._next = 0.0
        self._held = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        self._next = now + self.every
        if self._held:
            msg += f" ({self._held} more since the last such message)"
            self._held = 0
        log.warning(msg, *args)


def send_frames(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send a multipart message; large frames go without a copy."""
    last = len(frames) - 1
    if last == 0 and type(frames[0]) is bytes and len(frames[0]) < ZERO_COPY_MIN:
        raw_send(sock, frames[0])  # a small call or reply: one frame
        return
    for i, frame in enumerate(frames):
        raw_send(sock, frame, _SNDMORE if i < last else 0, not is_zero_copy(frame))


def answer_zap(
    zap: zmq.Socket[Any],
    user_of: Callable[[bytes], bytes | None],
    refused: Callable[[str, str], None],
) -> None:
    """Answer the ZAP request (RFC 27) pending on ``zap``, if any.

    A CURVE client whose public key ``user_of`` maps to a User-Id is admitted
    as that User-Id; any other is refused and told to ``refused(peer, mechanism)``.
    """
    try:
        req = zap.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return
    # version, request id, domain, address, identity (the server socket's own),
    # mechanism, credentials... The REP socket must answer every request,
    # whatever it holds, or it never reads another one.
    reply = [b"1.0", req[1] if len(req) > 1 else b"", b"400", b"key refused", b"", b""]
    try:
        mechanism = req[5] if len(req) > 5 else b""
        credentials = req[6:]
        user = None
        if mechanism == b"CURVE" and len(credentials) == 1:
            user = user_of(credentials[0])
        if user is not None:
            reply[2:5] = [b"200", b"OK", user]
        else:
            refused(
                bytes(req[3] if len(req) > 3 else b"?").decode(errors="replace"),
                bytes(mechanism).decode(errors="replace"),
            )
    finally:
        zap.send_multipart(reply)


def failed_handshakes(monitor: zmq.Socket[Any]) -> Iterator[Any]:
    """The events pending on a server socket's ``monitor`` (a handshake that fails before ZAP)."""
    from zmq.utils.monitor import recv_monitor_message

    while True:
        try:
            yield recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.ZMQError:  # zmq.Again: nothing more is pending
            return


class ControlChannel:
    """A CURVE ROUTER socket and the I/O thread that serves it."""

    def __init__(
        self,
        *,
        world_size: int,
        bind_host: str,
        advertise_host: str,
        on_message: OnMessage,
        on_tick: OnTick,
        tick: float = 0.25,
        name: str = "podium-torchrun",
    ) -> None:
        self.keys = CurveKeys(world_size)
        # ZAP: a client key -> the rank it belongs to (the connection's User-Id).
        self._key_rank = {
            z85.decode(public): str(rank).encode()
            for rank, (public, _) in enumerate(self.keys.clients)
        }
        # A message's identity -> the only User-Id (rank) allowed to use it.
        self._owner = {
            b"%s%d" % (side, rank): str(rank) for rank in range(world_size) for side in (b"w", b"s")
        }
        self._warn_refused = _RateLimitedWarning()
        self._warn_impostor = _RateLimitedWarning()
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick = tick
        self._outbox: deque[tuple[bytes, list[Any]]] = deque()
        self._closing = threading.Event()
        self.rejected = 0  # connection attempts refused (unknown key or no CURVE)
        self.impostors = 0  # messages dropped: sent under another rank's identity

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
        try:
            port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as exc:
            for sock in (self._monitor, self._router, self._zap):
                sock.close(linger=0)
            self.ctx.term()
            raise ValueError(
                f"cannot bind the control socket to {bind_host!r} ({exc}); set "
                "backend_options['bind_host'] (or 'controller_host') to an address of this host"
            ) from exc
        self.port = port
        self.address = f"tcp://{advertise_host}:{port}"
        # Workers on this host connect through a Unix socket instead: no TCP
        # stack (and no ACKs) per message, ~10% off a small call's round trip.
        # Same socket, so the same CURVE keys and ZAP check; the directory is
        # private to this user (0700).
        self._ipc_dir = tempfile.mkdtemp(prefix="podium-zmq-")
        self.ipc_address = f"ipc://{os.path.join(self._ipc_dir, 'control')}"
        try:
            self._router.bind(self.ipc_address)
        except zmq.ZMQError:  # e.g. a $TMPDIR too long for a socket path: TCP only
            self.ipc_address = ""

        # Whoever holds ``_io`` may use the sockets (see the module docstring).
        self._io = threading.Lock()
        self._holder = 0  # the thread that holds ``_io`` (its ident), 0 when free
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self._last_active = 0.0  # when a caller last sent or waited (monotonic)
        self._wake_r, self._wake_w = os.pipe()
        # Held while writing to the pipe and while closing it: a thread that
        # wakes the channel as it closes must not write into a reused fd.
        self._wake_lock = threading.Lock()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # One poller for the life of the channel; zmq_poll re-checks each
        # socket's pending events itself, so no readiness edge is ever lost.
        self._poller = zmq.Poller()
        for item in (self._router, self._zap, self._monitor, self._wake_r):
            self._poller.register(item, zmq.POLLIN)
        self._next_tick = time.monotonic()
        self._closed = False

        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called from any thread ---------------------------------------------

    def send(self, identity: bytes, frames: list[Any]) -> None:
        self.send_many([(identity, frames)])

    def send_many(self, messages: list[tuple[bytes, list[Any]]]) -> None:
        """Send now if the sockets are free, else queue for their holder (woken to send them)."""
        self._last_active = time.monotonic()
        # Queue first, then flush under the lock: messages leave in submission order.
        self._outbox.extend(messages)
        if self._io.acquire(blocking=False):
            self._holder = threading.get_ident()
            try:
                if not self._closed:
                    self._flush_outbox()
            finally:
                self._unlock()
        else:
            self._wake()

    def post(self, identity: bytes, frames: list[Any]) -> None:
        """Queue a message from a handler (the sockets' holder flushes it before it polls again)."""
        self._outbox.append((identity, frames))

    def wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``done()`` (a cheap check), serving the channel from this thread meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._waiters_lock:
            self._waiters += 1
        woke = False
        try:
            while not done():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                got = self._io.acquire(blocking=False)
                if not got:
                    # Held by the I/O thread (which yields to waiters once woken)
                    # or by another waiter (which may resolve us meanwhile: look
                    # at ``done`` every millisecond).
                    if not woke:
                        self._wake()
                        woke = True
                    got = self._io.acquire(timeout=0.001)
                if got:
                    self._holder = threading.get_ident()
                    try:
                        if self._closed:
                            return done()
                        self._pump(done, deadline)
                    finally:
                        self._unlock()
            return True
        finally:
            with self._waiters_lock:
                self._waiters -= 1
            self._last_active = time.monotonic()

    def held_here(self) -> bool:
        """Whether the calling thread serves the channel now (a handler, or code that interrupted one)."""
        return self._holder == threading.get_ident()

    def wake_waiters(self) -> None:
        """Make a thread serving the channel look at its ``done`` check now (a future failed elsewhere)."""
        self._wake()

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued messages, stop the I/O thread, close every socket and free the port."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._io:
            self._holder = threading.get_ident()
            self._closed = True
            try:
                self._flush_outbox()
            except zmq.ZMQError:
                pass
            for sock in (self._monitor, self._router, self._zap):
                sock.close(linger=0)
            self.ctx.term()
            self._holder = 0
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- serving ----------------------------------------------------------------

    def _unlock(self) -> None:
        """Release ``_io``; flush what a sender queued while we held it (it could not)."""
        self._holder = 0
        self._io.release()
        while self._outbox and not self._closed and self._io.acquire(blocking=False):
            self._holder = threading.get_ident()
            try:
                self._flush_outbox()
            finally:
                self._holder = 0
                self._io.release()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return  # closed
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):
                pass  # the pipe is full: a wake-up is pending anyway

    def _pump(self, done: Callable[[], bool] | None, deadline: float | None) -> None:
        """Serve the sockets (caller holds ``_io``) until ``done``, ``deadline`` or, for the
        I/O thread (``done`` is None), until a caller is active and nothing is pending."""
        while True:
            if self._outbox:
                self._flush_outbox()
            now = time.monotonic()
            if now >= self._next_tick:
                # Read everything already queued first: a tick judges heartbeats,
                # and those may have queued up while this process was paused or
                # busy sending. If the queue does not empty in time, read more
                # before ticking (a late tick reads as a pause; see on_tick).
                if self._drain(now + _DRAIN_MAX):
                    self._next_tick = now + self._tick
                    self._safely(self._on_tick, time.monotonic())
                continue  # the tick may have queued messages
            if done is None:
                if self._closing.is_set() or self._waiters or now - self._last_active < _QUIET:
                    return
            elif done():
                return
            wait = self._next_tick - now
            if deadline is not None:
                if now >= deadline:
                    return
                wait = min(wait, deadline - now)
            self._handle(self._poller.poll(max(1, math.ceil(wait * 1000))), done)

    def _drain(self, until: float) -> bool:
        """Handle every message that is ready now; False if some are left at ``until``."""
        while True:
            events = self._poller.poll(0)
            if not events:
                return True
            self._handle(events)
            if time.monotonic() >= until:
                return False

    def _handle(self, events: list[tuple[Any, int]], done: Callable[[], bool] | None = None) -> None:
        for item, _ in events:
            if item is self._router:
                # Everything queued now (replies of a call arrive together), a
                # bounded number, without polling again for each. A waiter whose
                # call has its last reply stops there: asking the socket whether
                # more are queued costs more than the check (the next poll sees them).
                router = self._router
                for _ in range(_RECV_BATCH):
                    self._recv_one()
                    if (done is not None and done()) or not router.get(_EVENTS) & _POLLIN:
                        break
            elif item == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except (BlockingIOError, OSError):
                    pass
            elif item is self._zap:
                self._safely(self._answer_zap)
            elif item is self._monitor:
                self._safely(self._read_monitor)

    def _loop(self) -> None:
        """The I/O thread: serve the sockets while no caller does (between calls, idle groups).

        An unexpected error is logged and the thread goes on serving: a group
        whose I/O thread died would read no heartbeat and take a live group for dead.
        """
        while not self._closing.is_set():
            try:
                if not self._serve_once():
                    return
            except Exception:
                log.exception("podium torchrun: error in the control channel's I/O thread")
                self._closing.wait(0.05)

    def _serve_once(self) -> bool:
        """One turn of the I/O thread; False once the channel is closed."""
        now = time.monotonic()
        if self._waiters == 0 and (
            now - self._last_active >= _QUIET or now >= self._next_tick or self._outbox
        ):
            if self._io.acquire(blocking=False):
                self._holder = threading.get_ident()
                try:
                    if self._closed:
                        return False
                    self._pump(None, None)
                finally:
                    self._unlock()
            now = time.monotonic()
        # A caller is active and serves the sockets itself while it waits:
        # keep off the GIL until it has been quiet for a while or a tick is due.
        quiet_left = _QUIET - (now - self._last_active)
        if self._waiters:
            nap = _QUIET
        elif quiet_left > 0:
            nap = min(quiet_left, self._next_tick - now)
        else:
            nap = 0.001  # someone holds the sockets for a moment
        self._closing.wait(max(nap, 0.001))
        return True

    def _flush_outbox(self) -> None:
        while self._outbox:
            identity, frames = self._outbox.popleft()
            try:
                raw_send(self._router, identity, _SNDMORE)
                send_frames(self._router, frames)
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the peer is gone; its supervisor's report or a
                # missed heartbeat turns that into an error at the caller.
                log.debug("could not send to %r: %s", identity, exc)

    def _recv_one(self) -> None:
        """Handle one message (poll said one is there; it returns at once if more are)."""
        router = self._router
        try:
            # A frame, for the connection's User-Id (the rank its key belongs to).
            first = router.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        if not first.more:  # ``Frame.more``: ~2x cheaper than ``get(RCVMORE)``
            return
        identity = first.bytes
        # The head is small: as bytes; the rest without a copy.
        head_frame = router.recv(copy=False)
        head = head_frame.bytes
        frames = router.recv_multipart(copy=False) if head_frame.more else []
        try:
            user = first.get("User-Id")
        except zmq.ZMQError:  # no User-Id: not admitted by our ZAP handler
            user = None
        if user is None or self._owner.get(identity) != user:
            self.impostors += 1
            self._warn_impostor(
                "podium torchrun: dropped a message sent as %r with the key of rank %s; "
                "a key is valid for its own rank only",
                identity,
                user,
            )
            return
        try:
            self._on_message(identity, head, frames)
        except Exception:  # a bug in a handler must not kill the I/O thread
            log.exception("podium torchrun: error in the control channel's handler")

    def _answer_zap(self) -> None:
        answer_zap(self._zap, self._key_rank.get, self._refused)  # User-Id: the key's rank

    def _refused(self, peer: str, mechanism: str) -> None:
        self.rejected += 1
        self._warn_refused(
            "podium torchrun: refused a connection from %s (mechanism %s, key not this "
            "group's); it cannot reach any worker",
            peer,
            mechanism,
        )

    def _read_monitor(self) -> None:
        for event in failed_handshakes(self._monitor):
            # Failed handshakes (no CURVE, wrong server key, garbage bytes) never
            # reach ZAP; the monitor is where they show.
            if event["event"] in (
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            ):
                self.rejected += 1
                self._warn_refused(
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
