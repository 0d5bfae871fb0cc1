"""A reader's kept connection to a shard server that went away."""

from __future__ import annotations

import socket
import threading

import pytest
import zmq

from podium.backends.torchrun import shardserver

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_kept_connection_to_a_gone_producer_closes_promptly(monkeypatch) -> None:
    # A kept connection whose producer ended retries the connect for as long
    # as it is kept, and each retry is a monitor event nobody reads while no
    # read is in progress. Thousands of them must not wedge the socket: closing
    # it (at the latest at interpreter exit) has to return.
    monkeypatch.setattr(shardserver, "_RECONNECT_IVL_MAX_MS", 0, raising=False)  # no back-off
    ctx = zmq.Context()
    ctx.setsockopt(zmq.RECONNECT_IVL, 1)  # new sockets retry every millisecond
    conn = shardserver._Connection(ctx, f"tcp://127.0.0.1:{_closed_port()}", b"x" * 32)
    deadline = threading.Event()
    deadline.wait(4.0)  # thousands of refused connects at 1 ms
    closer = threading.Thread(target=conn.close, daemon=True)
    closer.start()
    closer.join(10.0)
    assert not closer.is_alive(), "closing a connection with unread monitor events hung"
    ctx.term()
