"""Two simulated nodes on localhost (two torchrun agents, podium's static rendezvous), and the group's security."""

from __future__ import annotations

import os
import pickle
import socket
import time

import pytest
import zmq

from podium import ClassWithInitArgs, ResourcePool, Worker, WorkerGroup, load_backend, register
from podium.core.decorator import Dispatch

pytestmark = pytest.mark.timeout(180)

# torchx's template syntax ("$$", "$name") must reach the workers as it is.
DOLLARS = "a$$b$c ${d}"


class NodeWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        env = os.environ
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "env": {
                k: env.get(k)
                for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
            },
            "master": (env.get("MASTER_ADDR"), env.get("MASTER_PORT")),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shout(self, text: str) -> None:
        print(f"{text} from {self.rank}", flush=True)


@pytest.fixture(scope="module")
def wg():
    backend = load_backend("torchrun")
    group = WorkerGroup(
        ResourcePool([2, 2], use_gpu=False),
        ClassWithInitArgs(NodeWorker),
        backend=backend,
        worker_env={"PODIUM_TEST_DOLLARS": DOLLARS},
    )
    yield group
    group.shutdown()


def test_ranks_and_local_ranks_over_two_agents(wg: WorkerGroup) -> None:
    info = wg.where()
    assert [i["rank"] for i in info] == [0, 1, 2, 3]
    assert [i["local_rank"] for i in info] == [0, 1, 0, 1]
    assert {i["world_size"] for i in info} == {4}
    assert {i["local_world_size"] for i in info} == {2}
    for i in info:
        assert i["env"]["RANK"] == str(i["rank"]) and i["env"]["LOCAL_RANK"] == str(i["local_rank"])
    # two agents: ranks 0,1 on one node, 2,3 on the other
    assert (
        info[0]["env"]["GROUP_RANK"] == info[1]["env"]["GROUP_RANK"] != info[2]["env"]["GROUP_RANK"]
    )
    assert len({i["master"] for i in info}) == 1


def test_gloo_all_reduce(wg: WorkerGroup) -> None:
    assert wg.all_reduce() == [10.0] * 4


def test_output_reaches_controller_with_rank_prefix(
    wg: WorkerGroup, capfd: pytest.CaptureFixture[str]
) -> None:
    wg.shout("marker-7f3a")
    deadline = time.monotonic() + 5
    seen = ""
    while time.monotonic() < deadline:
        seen += capfd.readouterr().out
        if all(f"[rank {r}] marker-7f3a from {r}" in seen for r in range(4)):
            break
        time.sleep(0.05)
    for r in range(4):
        assert f"[rank {r}] marker-7f3a from {r}" in seen


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_unauthenticated_clients_execute_nothing(wg: WorkerGroup, tmp_path, caplog) -> None:
    group = wg._group
    port = group.channel.port
    target = tmp_path / "pwned"
    payload = pickle.dumps(_Evil(str(target)))
    before = group.channel.rejected
    caplog.set_level("WARNING", logger="podium.torchrun")

    # 1. raw TCP bytes
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(payload)
        time.sleep(0.3)
    ctx = zmq.Context()
    try:
        # 2. a ZeroMQ client without CURVE
        plain = ctx.socket(zmq.DEALER)
        plain.linger = 0
        plain.identity = b"w0"
        plain.connect(f"tcp://127.0.0.1:{port}")
        plain.send_multipart([b"call", payload, payload])
        # 3. a CURVE client that knows the server's public key but has its own keys
        pub, sec = zmq.curve_keypair()
        curve = ctx.socket(zmq.DEALER)
        curve.linger = 0
        curve.identity = b"w1"
        curve.curve_serverkey = group.channel.keys.server_public
        curve.curve_publickey = pub
        curve.curve_secretkey = sec
        curve.connect(f"tcp://127.0.0.1:{port}")
        curve.send_multipart([b"result", payload, payload])
        deadline = time.monotonic() + 5
        while group.channel.rejected < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        plain.close()
        curve.close()
    finally:
        ctx.term()
    time.sleep(0.3)
    assert not target.exists()
    assert group.channel.rejected >= before + 2
    assert any("refused a connection" in r.getMessage() for r in caplog.records)
    # the group keeps working
    assert [i["rank"] for i in wg.where()] == [0, 1, 2, 3]


def test_every_listener_of_the_group_is_on_loopback(wg: WorkerGroup, procs) -> None:
    wg.all_reduce()  # the workers' gloo process group is up (its pair sockets listen too)
    pids = procs.find(wg._group.gid)
    assert len(pids) >= 2 + 4 + 4  # two agents, four supervisors, four workers
    listeners = procs.listening(pids)
    assert listeners  # the agent's rendezvous store, gloo
    exposed = [s for s in listeners if s[1] not in ("127.0.0.1", "::1")]
    assert exposed == [], f"listening beyond loopback: {exposed}"


def test_torch_distributed_sockets_are_bound_to_loopback(wg: WorkerGroup) -> None:
    # (gloo binds to the address the host name resolves to: on most hosts not loopback)
    assert wg.env("GLOO_SOCKET_IFNAME") == ["lo"] * 4
    assert wg.env("NCCL_SOCKET_IFNAME") == ["lo"] * 4
    assert {a for a, _ in (i["master"] for i in wg.where())} == {"127.0.0.1"}


def test_worker_env_values_reach_the_workers_unchanged(wg: WorkerGroup) -> None:
    assert wg.env("PODIUM_TEST_DOLLARS") == [DOLLARS] * 4


def test_no_process_of_the_group_holds_a_secret_key_in_its_environment(
    wg: WorkerGroup, procs
) -> None:
    group = wg._group
    secrets = [secret for _, secret in group.channel.keys.clients]
    pids = procs.find(group.gid)
    assert len(pids) >= 2 + 4 + 4
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
        assert not any(secret in env for secret in secrets), f"pid {pid}"
        assert b"PODIUM_TR_CLIENT_SECRET" not in env
    # every rank read its key file and removed it (the last one, the directory)
    assert not os.path.exists(group.worker_env()["PODIUM_TR_KEYS"])
