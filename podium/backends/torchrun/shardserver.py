"""Reading a rank's exported shards from another host: the shard server and its client.

Each worker that exports a shard (``output="ref"``) serves its shards with a
:class:`ShardServer`: one ZeroMQ ROUTER socket and the thread that serves it,
started with the first export. A reader asks for ``(segment, rows, keys,
non-tensor columns)`` and gets only those rows of those keys, sliced at the
producer; tensor bytes travel as raw frames (zero-copy at the producer, one
copy into the reader's tensors), described by a msgpack head.

Who may read (see docs/trust-model.md):

- The server is a CURVE server whose key pair is its rank's own (the pair of
  the group's control channel); a reader learns the server's public key from
  the :class:`podium.BatchRef` the controller sent it, so it talks only to the
  real producer rank.
- Its ZAP handler admits one client key: the *reader key* of the controller
  that started the group. The controller makes that pair once per process and
  hands it, with each rank's own pair, to every rank of every group it starts
  through the rank's private key file (never the environment). So a reader
  proves it is a rank of a podium group of this controller (or the controller
  itself, for ``materialize()``); any other peer is refused in the handshake,
  and nothing it sends is read. Requests are msgpack, never pickle; the reader
  unpickles only the non-tensor columns it asked for, from the authenticated
  producer.

The server binds loopback when the scheduler runs every node on this host,
else the ``data_host`` backend option or this host's address as other hosts
see it. A reader never hangs on a dead producer: a refused connection, a
handshake that does not complete within :data:`CONNECT_TIMEOUT`, or a
connection that drops (ZMTP heartbeats find a host that is gone) before the
whole reply arrived is a :class:`podium.errors.DataLostError`; a reply is one
ZeroMQ message, so it arrives whole or not at all. A reader keeps one
connection per producer for later reads (the CURVE handshake costs
milliseconds); each request carries an id, so a late reply to an abandoned
request is never taken for the next one's, and a kept connection that fails is
retried once on a fresh one before the producer is taken for gone.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import torch
import zmq
from zmq.utils import z85

from podium.backends.torchrun.channel import (
    _RateLimitedWarning,
    answer_zap,
    failed_handshakes,
    reader_keys,
    send_frames,
)
from podium.core._batch_utils import Key
from podium.core.dataplane import Layout, _build, _rows_slice
from podium.core.protocol import DataProto
from podium.errors import DataLostError, PodiumError

__all__ = ["ShardServer", "client_stats", "fetch_remote"]

log = logging.getLogger("podium.torchrun")

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# A reader waits this long for the producer's handshake before it takes the producer for gone.
CONNECT_TIMEOUT = 5.0
# ZMTP heartbeats on a reader's connection: a producer host that is gone shows within seconds.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 4000
_TICK_MS = 100
# A kept connection to a producer that ended retries its connect, backing off to this interval.
_RECONNECT_IVL_MAX_MS = 2000

# -- wire -------------------------------------------------------------------------


def _key_out(key: Key) -> Any:
    return list(key) if isinstance(key, tuple) else key


def _key_in(key: Any) -> Key:
    return tuple(key) if isinstance(key, list) else str(key)


Lookup = Callable[[str], "tuple[np.ndarray, Layout] | None"]


class ShardServer:
    """Serves the shards of one worker process to authenticated readers on other hosts."""

    def __init__(
        self,
        *,
        keys: tuple[bytes, bytes],
        reader_public: bytes,
        bind_host: str,
        advertise_host: str,
        lookup: Lookup,
    ) -> None:
        self.public_key = keys[0]
        self._reader = z85.decode(reader_public)
        self._lookup = lookup
        self._warn_refused = _RateLimitedWarning()
        self.rejected = 0  # connection attempts refused (no CURVE, or not the reader key)
        self.served = 0  # requests answered with data
        self._closing = threading.Event()
        self.ctx = zmq.Context()
        # The ZAP handler must exist before the first handshake.
        self._zap = self.ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(_ZAP_ENDPOINT)
        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        self._router.sndhwm = 0
        self._router.rcvhwm = 0
        self._router.curve_server = True
        self._router.curve_publickey, self._router.curve_secretkey = keys
        self._router.zap_domain = b"podium-data"
        self._monitor = self._router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        )
        try:
            port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"cannot bind the shard server to {bind_host!r} ({exc}); set "
                "backend_options['data_host'] to an address of the worker hosts"
            ) from exc
        host = advertise_host if bind_host in ("0.0.0.0", "*", "::") else bind_host
        self.endpoint = f"tcp://{host}:{port}"
        self._thread = threading.Thread(target=self._loop, name="podium-shard-server", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._closing.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _close_sockets(self) -> None:
        for sock in (self._monitor, self._router, self._zap):
            sock.close(linger=0)
        self.ctx.term()

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self._router, self._zap, self._monitor):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                try:
                    events = dict(poller.poll(_TICK_MS))
                    if self._zap in events:
                        self._answer_zap()
                    if self._monitor in events:
                        self._read_monitor()
                    if self._router in events:
                        self._serve_one()
                except Exception:  # a bad request or a bug must not stop the server
                    log.exception("podium torchrun: error in the shard server")
        finally:
            self._close_sockets()

    def _answer_zap(self) -> None:
        answer_zap(self._zap, lambda key: b"reader" if key == self._reader else None, self._refused)

    def _refused(self, peer: str, mechanism: str) -> None:
        self.rejected += 1
        self._warn_refused(
            "podium torchrun: the shard server refused a connection from %s (mechanism %s, "
            "not this controller's reader key); it read nothing",
            peer,
            mechanism,
        )

    def _read_monitor(self) -> None:
        for _ in failed_handshakes(self._monitor):
            # No CURVE, garbage bytes: the handshake failed before ZAP.
            self.rejected += 1
            self._warn_refused(
                "podium torchrun: the shard server refused a connection that failed the CURVE "
                "handshake; it read nothing"
            )

    def _serve_one(self) -> None:
        router = self._router
        try:
            msg = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(msg) != 2:
            return  # not a request of ours (the sender was admitted, so log nothing)
        identity, head = msg
        req: Any = None
        try:
            req = msgpack.unpackb(head, raw=False)
            frames = self._answer(req)
        except _Refused as exc:
            frames = [
                msgpack.packb({"ok": False, "id": req["id"], "why": str(exc)}, use_bin_type=True)
            ]
        except Exception as exc:  # a malformed request
            rid = req.get("id") if isinstance(req, dict) else None
            frames = [
                msgpack.packb({"ok": False, "id": rid, "bad": repr(exc)[:200]}, use_bin_type=True)
            ]
        router.send(identity, zmq.SNDMORE)
        send_frames(router, frames)

    def _answer(self, req: dict[str, Any]) -> list[Any]:
        found = self._lookup(str(req["seg"]))
        if found is None:
            raise _Refused("its producer released it or is shutting down")
        buf, layout = found
        rows = np.frombuffer(req["rows"], dtype="<i8")
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= layout.nrows):
            raise ValueError(f"rows out of range 0..{layout.nrows}")
        sl = _rows_slice(rows)
        frames: list[Any] = []
        for key in req["keys"]:
            col = layout.column(_key_in(key))
            block = buf[col.offset : col.offset + layout.nrows * col.row_bytes].reshape(
                layout.nrows, col.row_bytes
            )
            frames.append(np.ascontiguousarray(block[sl] if sl is not None else block[rows]))
        objects = [str(o) for o in req["objects"]]
        if objects:
            off, nbytes = layout.objects_span
            stored = pickle.loads(buf[off : off + nbytes].tobytes())  # this rank's own data
            index: slice | np.ndarray = sl if sl is not None else rows
            frames.append(pickle.dumps({k: stored[k][index] for k in objects}, protocol=5))
        self.served += 1
        return [msgpack.packb({"ok": True, "id": req["id"]}, use_bin_type=True), *frames]


class _Refused(Exception):
    """The shard is not here (released, or its worker is stopping)."""


# -- the reader ---------------------------------------------------------------------

_lock = threading.Lock()
_stats = {"remote_reads": 0, "remote_bytes": 0, "connections": 0}
# At most this many producers' connections are kept open for reuse (the oldest goes first).
_MAX_CONNECTIONS = 64


def client_stats(reset: bool = False) -> dict[str, int]:
    """This process's reads through shard servers: reads, tensor bytes received, connections made."""
    with _lock:
        out = dict(_stats)
        if reset:
            for k in _stats:
                _stats[k] = 0
    return out


class _Connection:
    """One reader's connection to one shard server, kept for the next read.

    Its monitor says whether the CURVE handshake is done (``linked``) and
    whether the link dropped since; ZeroMQ reconnects by itself, and each
    request carries an id so that a late reply to an abandoned one is skipped.
    """

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, server_key: bytes) -> None:
        public, secret = reader_keys()
        self.endpoint = endpoint
        self.server_key = server_key
        self.lock = threading.Lock()
        self.used = False  # a read went through it (so a failure may be a stale link)
        self.closed = False
        self.linked = False
        sock = self.sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvhwm = 0
        sock.heartbeat_ivl = _HEARTBEAT_IVL_MS
        sock.heartbeat_timeout = _HEARTBEAT_TIMEOUT_MS
        sock.curve_serverkey = server_key
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.reconnect_ivl_max = _RECONNECT_IVL_MAX_MS
        # The monitor is read only while a read is in progress; between reads a
        # gone producer's connect retries pile up. libzmq sends monitor events
        # blocking, so a bounded queue that fills stalls the context's I/O thread
        # (and disable_monitor behind it): the queue is unbounded (a receiving
        # high-water mark of 0), and the back-off keeps it small.
        monitor_addr = f"inproc://podium-reader-monitor-{id(self)}-{next(_ids)}"
        sock.monitor(
            monitor_addr,
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_CONNECT_RETRIED
            | zmq.EVENT_DISCONNECTED,
        )
        self.monitor = ctx.socket(zmq.PAIR)
        self.monitor.rcvhwm = 0
        self.monitor.linger = 0
        self.monitor.connect(monitor_addr)
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        sock.connect(endpoint)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def events(self, shard_id: str) -> bool:
        """Read the monitor's events; whether the link dropped. Raises when the producer is gone."""
        from zmq.utils.monitor import recv_monitor_message

        dropped = False
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.ZMQError:
                return dropped
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.linked = True
            elif event == zmq.EVENT_DISCONNECTED:
                dropped = dropped or self.linked
                self.linked = False
            elif event == zmq.EVENT_CONNECT_RETRIED:
                raise self.lost(shard_id, "refuses connections (the worker ended)")
            elif event in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                # The peer closed or garbled the handshake: a worker that is
                # ending, or another process on the port of one that ended.
                raise self.lost(shard_id, "broke off the handshake (the worker ended)")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # its ZAP handler said no
                raise _KeyRefused(
                    f"the shard server at {self.endpoint} refused this process's reader key: only "
                    "ranks of groups started by the same controller can read each other's shards"
                )

    def lost(self, shard_id: str, why: str) -> DataLostError:
        return DataLostError(
            shard_id, None, detail=f"its producer's shard server at {self.endpoint} {why}"
        )

    def request(self, head: dict[str, Any], shard_id: str) -> None:
        """Send ``head`` and wait until its reply is next to read; never a hang on a dead producer."""
        self.events(shard_id)  # what happened since the last read
        self.sock.send(msgpack.packb(head, use_bin_type=True))
        start = time.monotonic()
        while True:
            ready = dict(self.poller.poll(_TICK_MS))
            if self.sock in ready:
                reply = msgpack.unpackb(self.sock.recv(), raw=False)
                if reply.get("id") == head["id"]:
                    self.pending = reply
                    return
                while self.sock.get(zmq.RCVMORE):  # a late reply to an abandoned request
                    self.sock.recv(copy=False)
                continue
            if self.monitor in ready and self.events(shard_id):
                if self.sock.poll(0):
                    continue  # the reply came whole before the link dropped
                raise self.lost(shard_id, "dropped the connection before it answered")
            if not self.linked and time.monotonic() - start > CONNECT_TIMEOUT:
                raise self.lost(
                    shard_id,
                    f"did not answer within {CONNECT_TIMEOUT:g} s (its host is unreachable or gone)",
                )

    pending: dict[str, Any]
    key: tuple[str, bytes, bytes]


class _KeyRefused(PodiumError):
    """The shard server does not admit this process's reader key."""


# (endpoint, server key, reader key) -> its connection, the most recently used last.
_connections: dict[tuple[str, bytes, bytes], _Connection] = {}
_ctx: zmq.Context[Any] | None = None
_ctx_pid = 0
_ids = itertools.count(1)


def _connection(endpoint: str, server_key: bytes) -> _Connection:
    global _ctx, _ctx_pid
    evicted: list[_Connection] = []
    with _lock:
        if _ctx is None or _ctx_pid != os.getpid():  # a forked child makes its own
            if _ctx is None:
                atexit.register(_close_all)
            _connections.clear()
            _ctx, _ctx_pid = zmq.Context(), os.getpid()
        key = (endpoint, server_key, reader_keys()[0])
        conn = _connections.pop(key, None)
        if conn is None:
            conn = _Connection(_ctx, endpoint, server_key)
            conn.key = key
            _stats["connections"] += 1
        _connections[key] = conn
        while len(_connections) > _MAX_CONNECTIONS:
            evicted.append(_connections.pop(next(iter(_connections))))
    for old in evicted:  # outside _lock: a reader may hold its lock and want _lock
        with old.lock:
            old.close()
    return conn


def _close_all() -> None:
    """Close the kept connections (at exit: no socket is left for the collector to find)."""
    with _lock:
        conns = list(_connections.values())
        _connections.clear()
    for conn in conns:
        conn.close()


def _forget(conn: _Connection) -> None:
    with _lock:
        if _connections.get(conn.key) is conn:
            del _connections[conn.key]
    conn.close()


def fetch_remote(
    endpoint: str,
    server_key: bytes,
    shard_id: str,
    segment: str,
    layout: Layout,
    rows: np.ndarray,
    keys: Sequence[Key],
    objects: Sequence[str],
    meta_info: dict[str, Any],
) -> DataProto | Any:
    """Rows ``rows`` of ``keys`` and ``objects`` of one shard, from its producer's shard server.

    A connection kept from an earlier read that fails is retried once on a
    fresh one (its link may have gone stale); a fresh one's failure is final.
    """
    for attempt in range(2):
        conn = _connection(endpoint, server_key)
        stale = conn.used
        with conn.lock:
            if conn.closed:  # evicted between the look-up and the lock
                continue
            try:
                part = _read(conn, shard_id, segment, layout, rows, keys, objects, meta_info)
            except _KeyRefused:
                _forget(conn)
                raise
            except DataLostError:
                _forget(conn)
                if stale and attempt == 0:
                    continue
                raise
            except BaseException:
                _forget(conn)  # whatever is left of its reply must not meet the next request
                raise
            conn.used = True
            return part
    raise DataLostError(
        shard_id, None, detail=f"its producer's shard server at {endpoint} could not be read"
    )


def _read(
    conn: _Connection,
    shard_id: str,
    segment: str,
    layout: Layout,
    rows: np.ndarray,
    keys: Sequence[Key],
    objects: Sequence[str],
    meta_info: dict[str, Any],
) -> DataProto | Any:
    m = int(rows.size)
    head = {
        "id": next(_ids),
        "seg": segment,
        "rows": np.ascontiguousarray(rows, dtype="<i8").tobytes(),
        "keys": [_key_out(k) for k in keys],
        "objects": list(objects),
    }
    conn.request(head, shard_id)
    reply, sock, endpoint = conn.pending, conn.sock, conn.endpoint
    if not reply.get("ok"):
        while sock.get(zmq.RCVMORE):
            sock.recv(copy=False)
        if "why" in reply:
            raise DataLostError(shard_id, None, detail=str(reply["why"]))
        raise PodiumError(f"the shard server at {endpoint} refused the request: {reply.get('bad')}")
    tensors: dict[Key, torch.Tensor] = {}
    received = 0
    for key in keys:
        col = layout.column(key)
        t = torch.empty((m, *col.row_shape), dtype=col.dtype)
        into = t.view(-1).view(torch.uint8).numpy() if t.numel() else bytearray()
        _recv_part(sock, into, m * col.row_bytes, endpoint)
        tensors[key] = t
        received += m * col.row_bytes
    non_tensors: dict[str, np.ndarray] = {}
    if objects:
        if not sock.get(zmq.RCVMORE):
            raise PodiumError(f"the shard server at {endpoint} sent no non-tensor columns")
        # From the producer rank itself (CURVE authenticated it), with the keys the controller gave.
        non_tensors = pickle.loads(sock.recv())
    if sock.get(zmq.RCVMORE):
        raise PodiumError(f"the shard server at {endpoint} sent more parts than asked for")
    with _lock:
        _stats["remote_reads"] += 1
        _stats["remote_bytes"] += received
    return _build(layout.kind, tensors, non_tensors, m, meta_info)


def _recv_part(sock: zmq.Socket[Any], into: Any, nbytes: int, endpoint: str) -> None:
    if not sock.get(zmq.RCVMORE):
        raise PodiumError(f"the shard server at {endpoint} sent fewer parts than asked for")
    got = sock.recv_into(into) if nbytes else len(sock.recv())
    if got != nbytes:
        raise PodiumError(
            f"the shard server at {endpoint} sent {got} bytes where {nbytes} were due"
        )
