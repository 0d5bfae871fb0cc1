"""The control channel's authentication, with real ZeroMQ sockets and no worker processes.

(Whole groups are checked in test_multinode.py: listeners, environments, keys.)
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from podium import ClassWithInitArgs, ResourcePool, Worker, load_backend
from podium.backends.torchrun import wire
from podium.backends.torchrun.channel import ControlChannel, reader_keys
from podium.backends.torchrun.group import TorchrunGroup
from podium.backends.torchrun.launch import dryrun
from podium.core.backend import GroupSpec

pytestmark = pytest.mark.timeout(60)


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


class _Received:
    """A channel's ``on_message``: what arrived, by identity."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes]] = []
        self.cond = threading.Condition()

    def __call__(self, identity: bytes, head: bytes, frames: list[Any]) -> None:
        with self.cond:
            self.messages.append((identity, head))
            self.cond.notify_all()

    def wait_for(self, identity: bytes, timeout: float = 15.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: any(i == identity for i, _ in self.messages), timeout)


@pytest.fixture
def channel() -> Iterator[tuple[ControlChannel, _Received]]:
    received = _Received()
    chan = ControlChannel(
        world_size=2,
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        on_message=received,
        on_tick=lambda now: None,
    )
    chan.start()
    yield chan, received
    chan.close()


def _client(ctx: zmq.Context[Any], chan: ControlChannel, identity: bytes, keys: Any) -> Any:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = identity
    sock.curve_serverkey = chan.keys.server_public
    sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(f"tcp://127.0.0.1:{chan.port}")
    return sock


def test_a_rank_key_speaks_for_its_own_rank_only(channel) -> None:
    chan, received = channel
    rank1 = chan.keys.clients[1]
    ctx = zmq.Context()
    try:
        impostors = [_client(ctx, chan, ident, rank1) for ident in (b"w0", b"s0")]
        for sock in impostors:
            sock.send(wire.BEAT)
        honest = _client(ctx, chan, b"w1", rank1)
        honest.send(wire.BEAT)
        assert received.wait_for(b"w1")
        deadline = time.monotonic() + 10
        while chan.impostors < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        for sock in [*impostors, honest]:
            sock.close()
    finally:
        ctx.term()
    assert chan.impostors == 2
    assert {i for i, _ in received.messages} == {b"w1"}


def test_each_rank_has_its_own_key_pair(channel) -> None:
    chan, _ = channel
    publics = [public for public, _ in chan.keys.clients]
    assert len(publics) == 2 and len(set(publics)) == 2
    assert set(chan.keys.worker_env()) == {"PODIUM_TR_SERVER_KEY"}  # public only


def test_refused_connections_are_logged_at_most_once_a_minute(channel, caplog) -> None:
    chan, _ = channel
    caplog.set_level(logging.WARNING, logger="podium.torchrun")
    ctx = zmq.Context()
    try:
        for _ in range(10):
            with socket.create_connection(("127.0.0.1", chan.port), timeout=2) as s:
                s.sendall(b"\xff" * 64)
        strangers = [_client(ctx, chan, b"w0", zmq.curve_keypair()) for _ in range(5)]
        deadline = time.monotonic() + 15
        while chan.rejected < 15 and time.monotonic() < deadline:
            time.sleep(0.05)
        for sock in strangers:
            sock.close()
    finally:
        ctx.term()
    assert chan.rejected >= 15
    warnings = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(warnings) == 1


def test_a_malformed_zap_request_does_not_stop_the_channel(channel) -> None:
    chan, received = channel
    # Only code in the controller's own process can reach the ZAP endpoint;
    # whatever it gets, the handler answers and the channel keeps serving.
    req = chan.ctx.socket(zmq.REQ)
    req.linger = 0
    req.rcvtimeo = 10_000
    req.connect("inproc://zeromq.zap.01")
    try:
        req.send(b"1.0")
        assert req.recv_multipart()[2] == b"400"
    finally:
        req.close()
    ctx = zmq.Context()
    try:
        sock = _client(ctx, chan, b"w0", chan.keys.clients[0])
        sock.send(wire.BEAT)
        assert received.wait_for(b"w0")
        sock.close()
    finally:
        ctx.term()


# -- a group's controller end (no processes started) ----------------------------------


@pytest.fixture
def group() -> Iterator[TorchrunGroup]:
    backend = load_backend("torchrun")
    spec = GroupSpec(
        pool=ResourcePool([2], use_gpu=False),
        cls_with_init=ClassWithInitArgs(Worker),
        name_prefix="sec",
    )
    g = TorchrunGroup(spec, backend.config)
    yield g
    g.close_channel()


def test_control_headers_are_never_unpickled(group: TorchrunGroup, tmp_path) -> None:
    # A peer with a valid key (a compromised rank) sends control messages
    # whose metadata would run code if unpickled.
    target = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(target)))
    chan = group.channel
    ctx = zmq.Context()
    try:
        sup = _client(ctx, chan, b"s0", chan.keys.clients[0])
        work = _client(ctx, chan, b"w0", chan.keys.clients[0])
        for kind in (wire.BEAT, wire.EXIT):
            sup.send(kind + evil)
        for kind in (wire.HELLO, wire.READY, wire.RESULT):
            work.send(kind + evil)
        sup.send(wire.BEAT)
        deadline = time.monotonic() + 10
        while group._ranks[0].last_beat == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        sup.close()
        work.close()
    finally:
        ctx.term()
    assert group._ranks[0].last_beat > 0  # the messages were read
    assert not target.exists()
    with pytest.raises(ValueError):
        wire.split_head(wire.HELLO + evil)


def test_keys_wait_in_private_files_not_in_the_environment(group: TorchrunGroup) -> None:
    env = group.worker_env()
    secrets = [secret.decode() for _, secret in group.channel.keys.clients]
    assert not any(s in value for value in env.values() for s in secrets)
    directory = env["PODIUM_TR_KEYS"]
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for rank, (public, secret) in enumerate(group.channel.keys.clients):
        path = os.path.join(directory, f"rank-{rank}")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with open(path, "rb") as f:
            # Its own pair, then the controller's reader pair (for shard servers).
            assert f.read().split() == [public, secret, *reader_keys()]
    group.close_channel()
    assert not os.path.exists(directory)


def test_a_slurm_job_script_holds_no_secret(group: TorchrunGroup) -> None:
    backend = load_backend("torchrun", scheduler="slurm", scheduler_cfg={"partition": "gpu"})
    app = backend.app_for(group.spec, group.worker_env())
    script = dryrun(backend.runner(), app, "slurm", {"partition": "gpu"}).request.materialize()
    assert "PODIUM_TR_KEYS=" in script
    for _, secret in group.channel.keys.clients:
        assert secret.decode() not in script


def test_the_shared_memory_probe_is_private(group: TorchrunGroup) -> None:
    if group._probe is None:
        pytest.skip("no /dev/shm here")
    name = group._probe.partition(":")[0]
    assert stat.S_IMODE(os.lstat(os.path.join("/dev/shm", name)).st_mode) == 0o600


def test_key_dir_option_places_the_keys(tmp_path) -> None:
    backend = load_backend("torchrun", key_dir=str(tmp_path))
    spec = GroupSpec(
        pool=ResourcePool([1], use_gpu=False),
        cls_with_init=ClassWithInitArgs(Worker),
        name_prefix="k",
    )
    g = TorchrunGroup(spec, backend.config)
    try:
        directory = g.worker_env()["PODIUM_TR_KEYS"]
        assert os.path.dirname(directory) == str(tmp_path)
        assert os.listdir(directory) == ["rank-0"]
    finally:
        g.close_channel()
    assert os.listdir(tmp_path) == []


def test_a_key_dir_that_is_not_a_directory_is_refused(tmp_path) -> None:
    from podium import WorkerGroup

    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"key_dir.*not a directory"):
        WorkerGroup(
            ResourcePool([1], use_gpu=False),
            ClassWithInitArgs(Worker),
            backend="torchrun",
            backend_options={"key_dir": missing},
        )


def test_an_interface_the_user_chose_is_kept() -> None:
    backend = load_backend("torchrun")
    spec = GroupSpec(
        pool=ResourcePool([2], use_gpu=False),
        cls_with_init=ClassWithInitArgs(Worker),
        name_prefix="i",
    )
    env = backend.app_for(spec, {"GLOO_SOCKET_IFNAME": "eth9"}).roles[0].env
    assert env["GLOO_SOCKET_IFNAME"] == "eth9" and env["NCCL_SOCKET_IFNAME"] == "lo"
