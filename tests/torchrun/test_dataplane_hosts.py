"""BatchRefs read across hosts on torchrun: each producer rank's shard server, end to end.

Every process here runs on one machine, so the readers are told to treat
producers as remote (the ``shard_network`` option in the workers,
``PODIUM_TR_SHARD_NETWORK=1`` in this process): each read goes through the
producer's CURVE-authenticated shard server, over TCP, as it does between hosts.
The producer group runs on two torchrun agents (two simulated nodes).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from podium import (
    BatchRef,
    ClassWithInitArgs,
    DataLostError,
    PodiumError,
    ResourcePool,
    WorkerDiedError,
    WorkerGroup,
    get,
    load_backend,
    register,
)
from podium.backends.torchrun import channel, shardserver
from podium.backends.torchrun.dataplane import NETWORK_ENV
from podium.core.backend import Backend
from podium.core.decorator import Dispatch
from podium.testing.conformance.dataplane_tests import assert_same, rows
from podium.testing.conformance.workers import ConformanceWorker

pytestmark = pytest.mark.timeout(180)


class HostsWorker(ConformanceWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def network_stats(self, reset: bool = False) -> dict[str, Any]:
        from podium.backends.torchrun.shardserver import client_stats
        from podium.core import dataplane

        server = getattr(dataplane._exporter, "_server", None)
        return {
            **client_stats(reset),
            "served": server.served if server is not None else 0,
            "rejected": server.rejected if server is not None else 0,
            "pid": os.getpid(),
        }


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(NETWORK_ENV, "1")  # the controller's materialize() reads remotely too
        yield load_backend("torchrun", shard_network=True)


@pytest.fixture(scope="module")
def producers(backend: Backend) -> Iterator[WorkerGroup]:
    group = WorkerGroup(
        ResourcePool([1, 1], use_gpu=False), ClassWithInitArgs(HostsWorker), backend=backend
    )
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def consumers(backend: Backend) -> Iterator[WorkerGroup]:
    group = WorkerGroup(
        ResourcePool([3], use_gpu=False), ClassWithInitArgs(HostsWorker), backend=backend
    )
    yield group
    group.shutdown()


def transport_of(ref: BatchRef, shard: int = 0) -> Any:
    return ref._shards[shard].info.transport


def test_chain_through_shard_servers_equals_dataproto_calls(
    producers: WorkerGroup, consumers: WorkerGroup
) -> None:
    shardserver.client_stats(reset=True)
    producers.network_stats(reset=True)
    consumers.network_stats(reset=True)
    data = rows(7)  # uneven: A(2) pads to 8, B(3) to 9 -- in the index only
    a = producers.ref_stage(data, scale=2.0)
    b = consumers.ref_stage(a, scale=3.0)
    c = producers.ref_stage(b, scale=5.0)
    want = producers.value_stage(
        consumers.value_stage(producers.value_stage(data, scale=2.0), scale=3.0), scale=5.0
    )
    assert_same(c.materialize(), want)
    assert_same(get(b), consumers.value_stage(producers.value_stage(data, scale=2.0), scale=3.0))
    assert list(c.materialize().non_tensor_batch["uid"]) == [f"u{i}" for i in range(7)]
    # Every read crossed a shard server: none mapped the producer's shared memory.
    assert all(
        transport_of(r, s).endpoint.startswith("tcp://127.0.0.1:")
        for r in (a, b, c)
        for s in range(2)
    )
    readers = consumers.network_stats() + producers.network_stats()
    assert all(s["remote_reads"] >= 1 for s in readers)
    assert sum(s["served"] for s in readers) >= 3 + 2  # B's 3 ranks read A, C's 2 read B
    assert shardserver.client_stats()["remote_reads"] >= 2  # the controller's materialize()


def test_consumer_receives_only_its_rows_and_keys(
    producers: WorkerGroup, consumers: WorkerGroup
) -> None:
    ref = producers.ref_stage(rows(6))
    consumers.network_stats(reset=True)
    out = consumers.received(ref.select(["y"], ["uid"]))
    assert [o["keys"] for o in out] == [["y", "uid"]] * 3
    assert [o["uid"] for o in out] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    # 2 rows of one float32 key each: sliced at the producer, not the whole shard.
    assert [s["remote_bytes"] for s in consumers.network_stats()] == [2 * 4] * 3
    # Scattered rows across both producers' shards, read back in the order asked for.
    picked = ref[[5, 0, 3, 2]]
    got = picked.materialize()
    want = get(ref)
    assert got.batch["y"].tolist() == [want.batch["y"][i].item() for i in (5, 0, 3, 2)]
    assert list(got.non_tensor_batch["uid"]) == ["u5", "u0", "u3", "u2"]
    ref.release()


def _request(sock: zmq.Socket[Any], segment: str) -> None:
    head = {
        "seg": segment,
        "rows": np.arange(1, dtype="<i8").tobytes(),
        "keys": ["y"],
        "objects": [],
    }
    sock.send(msgpack.packb(head, use_bin_type=True))


def test_a_client_without_the_reader_key_gets_nothing(
    producers: WorkerGroup, caplog: pytest.LogCaptureFixture
) -> None:
    ref = producers.ref_stage(rows(4))
    transport = transport_of(ref)
    before = producers.network_stats()[0]["rejected"]
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        stranger = ctx.socket(zmq.DEALER)  # CURVE, the right server key, a key of its own
        stranger.curve_serverkey = transport.server_key
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        for sock in (plain, stranger):
            sock.linger = 0
            sock.connect(transport.endpoint)
            _request(sock, transport.name)
        time.sleep(1.0)
        for sock in (plain, stranger):
            assert sock.poll(0) == 0  # no answer, ever
            sock.close()
    finally:
        ctx.term()
    host, port = transport.endpoint[len("tcp://") :].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as raw:  # raw bytes
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" * 8)
        time.sleep(0.3)
    # The same request from a process with another controller's reader key: refused.
    mine = channel.reader_keys()
    channel.set_reader_keys(*zmq.curve_keypair())
    try:
        with pytest.raises(PodiumError, match="refused this process's reader key"):
            transport.read(ref._shards[0].info, np.arange(2), ["y"], [], {})
    finally:
        channel.set_reader_keys(*mine)
    deadline = time.monotonic() + 5
    while producers.network_stats()[0]["rejected"] - before < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert producers.network_stats()[0]["rejected"] - before >= 3
    # With this controller's reader key the same read works.
    assert transport.read(ref._shards[0].info, np.arange(2), ["y"], [], {}).batch["y"].shape == (2,)
    ref.release()


def test_killed_producer_is_data_lost_within_seconds(
    backend: Backend, consumers: WorkerGroup
) -> None:
    doomed = WorkerGroup(
        ResourcePool([1], use_gpu=False), ClassWithInitArgs(HostsWorker), backend=backend
    )
    try:
        ref = doomed.ref_stage(rows(3))
        info = ref._shards[0].info
        pid = doomed.network_stats()[0]["pid"]
        # Stopped (its shard server cannot answer the handshake): lost after CONNECT_TIMEOUT
        # -- or sooner, if the group's heartbeat_timeout (4 s) declares the stopped rank dead
        # first and its processes go (then the port refuses the reconnection).
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(DataLostError, match="did not answer|the worker ended"):
                info.transport.read(info, np.arange(3), ["y"], [], {})
        finally:
            os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - start < shardserver.CONNECT_TIMEOUT + 3
        # Killed: its port refuses connections, seen at once, before the controller knows.
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(DataLostError, match="the worker ended"):
            info.transport.read(info, np.arange(3), ["y"], [], {})
        assert time.monotonic() - start < 3
        with pytest.raises(WorkerDiedError):
            doomed.ref_stage(rows(3))
        start = time.monotonic()
        with pytest.raises(DataLostError):
            consumers.received(ref)
        with pytest.raises(DataLostError):
            ref.materialize()
        assert time.monotonic() - start < 10
    finally:
        doomed.shutdown()
    assert len(consumers.received(rows(3))) == 3  # the consumer group is unharmed
