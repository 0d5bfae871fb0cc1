"""The machine's limits, with no framework at all: what podium's figures are bounded by.

- ``pipe``: a 1-byte round trip between two processes over OS pipes (``latency_ms@1``);
- ``zmq-curve``: a bare CURVE-encrypted ZeroMQ ROUTER sending one small message to each of
  N DEALER processes over ``ipc://`` and collecting their N replies -- podium-torchrun's
  control channel with nothing else (``latency_ms@N``);
- ``memcpy``: one ``memcpy`` of a batch between two resident buffers (``data_gib_s@MiB``).
  A round trip through shared memory needs at least three such passes (write the batch,
  the result, the collect); the report divides by three.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from benchmarks._common import MIB, Sizes, gib_s, latency_ms, timed


def _echo(inbox: Connection, outbox: Connection) -> None:
    while (msg := inbox.recv_bytes()) != b"stop":
        outbox.send_bytes(msg)


def _dealer(address: str, server_public: bytes, ident: bytes) -> None:
    import zmq

    public, secret = zmq.curve_keypair()
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    sock.identity = ident
    sock.connect(address)
    sock.send(b"hello")
    while (msg := sock.recv()) != b"stop":
        sock.send(msg)
    sock.close(linger=0)


def pipe_ms(sizes: Sizes) -> float:
    ctx = mp.get_context("spawn")
    child_in, to_child = ctx.Pipe(duplex=False)  # (reading end, writing end)
    from_child_r, from_child_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_echo, args=(child_in, from_child_w), daemon=True)
    proc.start()

    def trip() -> None:
        to_child.send_bytes(b"x")
        from_child_r.recv_bytes()

    try:
        return latency_ms(trip, sizes)
    finally:
        to_child.send_bytes(b"stop")
        proc.join(10)


def zmq_ms(n: int, sizes: Sizes) -> float:
    import zmq

    public, secret = zmq.curve_keypair()
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.curve_server, router.curve_publickey, router.curve_secretkey = True, public, secret
    with tempfile.TemporaryDirectory(prefix="bench-zmq-") as tmp:
        address = f"ipc://{os.path.join(tmp, 'control')}"
        router.bind(address)
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_dealer, args=(address, public, b"d%d" % i), daemon=True)
            for i in range(n)
        ]
        for p in procs:
            p.start()
        idents = [router.recv_multipart()[0] for _ in procs]

        def fan_out() -> None:
            for ident in idents:
                router.send_multipart([ident, b"x"])
            for _ in idents:
                router.recv_multipart()

        try:
            return latency_ms(fan_out, sizes)
        finally:
            for ident in idents:
                router.send_multipart([ident, b"stop"])
            for p in procs:
                p.join(10)
            router.close(linger=0)


def memcpy_gib_s(mib: int, trips: int) -> float:
    src = np.random.randint(0, 255, mib * MIB, dtype=np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)  # resident before timing
    return gib_s(mib, timed(lambda: np.copyto(dst, src), trips))


def run(sizes: Sizes, t0: float) -> dict[str, Any]:
    out: dict[str, float] = {}
    if sizes.wants("latency"):
        out["pipe:latency_ms@1"] = pipe_ms(sizes)
        for n in sizes.latency_workers:
            out[f"zmq-curve:latency_ms@{n}"] = zmq_ms(n, sizes)
    if sizes.wants("data"):
        for mib in sizes.data_mib:
            out[f"memcpy:data_gib_s@{mib}"] = memcpy_gib_s(mib, sizes.trips(mib))
    return out
