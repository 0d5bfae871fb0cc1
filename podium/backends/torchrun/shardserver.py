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
ZeroMQ message, so it arrives whole or not at all.
"""

from __future__ import annotations

import logging
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

from podium.backends.torchrun.channel import _RateLimitedWarning, reader_keys, send_frames
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
        try:
            req = self._zap.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        # RFC 27; the REP socket must answer every request, whatever it holds.
        reply = [b"1.0", req[1] if len(req) > 1 else b"", b"400", b"not a reader", b"", b""]
        try:
            mechanism = req[5] if len(req) > 5 else b""
            credentials = req[6:]
            if mechanism == b"CURVE" and credentials == [self._reader]:
                reply[2:5] = [b"200", b"OK", b"reader"]
            else:
                self.rejected += 1
                self._warn_refused(
                    "podium torchrun: the shard server refused a connection from %s (mechanism %s, "
                    "not this controller's reader key); it read nothing",
                    bytes(req[3] if len(req) > 3 else b"?").decode(errors="replace"),
                    bytes(mechanism).decode(errors="replace"),
                )
        finally:
            self._zap.send_multipart(reply)

    def _read_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
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
        try:
            frames = self._answer(msgpack.unpackb(head, raw=False))
        except _Refused as exc:
            frames = [msgpack.packb({"ok": False, "why": str(exc)}, use_bin_type=True)]
        except Exception as exc:  # a malformed request
            frames = [msgpack.packb({"ok": False, "bad": repr(exc)[:200]}, use_bin_type=True)]
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
        return [msgpack.packb({"ok": True}, use_bin_type=True), *frames]


class _Refused(Exception):
    """The shard is not here (released, or its worker is stopping)."""


# -- the reader ---------------------------------------------------------------------

_ctx: zmq.Context[Any] | None = None
_ctx_lock = threading.Lock()
_stats = {"remote_reads": 0, "remote_bytes": 0}


def client_stats(reset: bool = False) -> dict[str, int]:
    """This process's reads through shard servers: how many, and the tensor bytes received."""
    with _ctx_lock:
        out = dict(_stats)
        if reset:
            for k in _stats:
                _stats[k] = 0
    return out


def _context() -> zmq.Context[Any]:
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            _ctx = zmq.Context()
        return _ctx


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
    """Rows ``rows`` of ``keys`` and ``objects`` of one shard, from its producer's shard server."""
    public, secret = reader_keys()
    sock = _context().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvhwm = 0
    sock.heartbeat_ivl = _HEARTBEAT_IVL_MS
    sock.heartbeat_timeout = _HEARTBEAT_TIMEOUT_MS
    sock.curve_serverkey = server_key
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_CONNECT_RETRIED
        | zmq.EVENT_DISCONNECTED
    )
    m = int(rows.size)
    try:
        sock.connect(endpoint)
        head = {
            "seg": segment,
            "rows": np.ascontiguousarray(rows, dtype="<i8").tobytes(),
            "keys": [_key_out(k) for k in keys],
            "objects": list(objects),
        }
        sock.send(msgpack.packb(head, use_bin_type=True))
        _await_reply(sock, monitor, endpoint, shard_id)
        reply = msgpack.unpackb(sock.recv(), raw=False)
        if not reply.get("ok"):
            if "why" in reply:
                raise DataLostError(shard_id, None, detail=str(reply["why"]))
            raise PodiumError(
                f"the shard server at {endpoint} refused the request: {reply.get('bad')}"
            )
        tensors: dict[Key, torch.Tensor] = {}
        received = 0
        for key in keys:
            col = layout.column(key)
            t = torch.empty((m, *col.row_shape), dtype=col.dtype)
            _recv_part(
                sock,
                t.view(-1).view(torch.uint8).numpy() if t.numel() else bytearray(),
                m * col.row_bytes,
                endpoint,
            )
            tensors[key] = t
            received += m * col.row_bytes
        non_tensors: dict[str, np.ndarray] = {}
        if objects:
            if not sock.get(zmq.RCVMORE):
                raise PodiumError(f"the shard server at {endpoint} sent no non-tensor columns")
            # From the producer rank itself (CURVE authenticated it), with the keys the controller gave.
            non_tensors = pickle.loads(sock.recv())
        with _ctx_lock:
            _stats["remote_reads"] += 1
            _stats["remote_bytes"] += received
        return _build(layout.kind, tensors, non_tensors, m, meta_info)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def _recv_part(sock: zmq.Socket[Any], into: Any, nbytes: int, endpoint: str) -> None:
    if not sock.get(zmq.RCVMORE):
        raise PodiumError(f"the shard server at {endpoint} sent fewer parts than asked for")
    got = sock.recv_into(into) if nbytes else len(sock.recv())
    if got != nbytes:
        raise PodiumError(
            f"the shard server at {endpoint} sent {got} bytes where {nbytes} were due"
        )


def _await_reply(
    sock: zmq.Socket[Any], monitor: zmq.Socket[Any], endpoint: str, shard_id: str
) -> None:
    """Wait until the reply is there; a producer that is gone is :class:`DataLostError`, never a hang."""
    from zmq.utils.monitor import recv_monitor_message

    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    start = time.monotonic()
    linked = False

    def lost(why: str) -> DataLostError:
        return DataLostError(
            shard_id, None, detail=f"its producer's shard server at {endpoint} {why}"
        )

    while True:
        events = dict(poller.poll(_TICK_MS))
        if sock in events:
            return
        if monitor in events:
            while True:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                except zmq.ZMQError:
                    break
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    linked = True
                elif event == zmq.EVENT_CONNECT_RETRIED and not linked:
                    raise lost("refuses connections (the worker ended)")
                elif event == zmq.EVENT_DISCONNECTED and linked:
                    # Whatever arrived before the drop is whole: look once more.
                    if poller.poll(0) and sock.poll(0):
                        return
                    raise lost("dropped the connection before it answered (the worker ended)")
                elif event in (
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                ):
                    # The peer closed or garbled the handshake: a worker that is
                    # ending, or another process on the port of one that ended.
                    raise lost("broke off the handshake (the worker ended)")
                elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # its ZAP handler said no
                    raise PodiumError(
                        f"the shard server at {endpoint} refused this process's reader key: only "
                        "ranks of groups started by the same controller can read each other's shards"
                    )
        if not linked and time.monotonic() - start > CONNECT_TIMEOUT:
            raise lost(
                f"did not answer within {CONNECT_TIMEOUT:g} s (its host is unreachable or gone)"
            )
