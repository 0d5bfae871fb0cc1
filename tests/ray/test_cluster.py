"""The Ray backend on a several-node cluster (``ray.cluster_utils.Cluster``: raylets on one host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from _raytools import eventually, live_actor_names, live_placement_groups, restart_ray, stop_ray
from ray.cluster_utils import Cluster

from podium import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, register
from podium.errors import ResourceUnavailableError

pytestmark = pytest.mark.timeout(180)

CPUS_PER_NODE = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    restart_ray()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=CPUS_PER_NODE)
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    stop_ray()
    c.shutdown()


class Where(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> dict[str, Any]:
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "local_rank": os.environ["LOCAL_RANK"],
            "local_world_size": os.environ["LOCAL_WORLD_SIZE"],
        }


def test_pool_spans_nodes_with_ranks_ordered_by_node(cluster: Cluster) -> None:
    with WorkerGroup(
        ResourcePool([2, 2], use_gpu=False), ClassWithInitArgs(Where), backend="ray"
    ) as wg:
        info = wg.where()
    nodes = [i["node"] for i in info]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    assert (ip[nodes[0]], nodes[0]) < (ip[nodes[2]], nodes[2])  # node IP first, node id breaks ties
    assert [i["local_rank"] for i in info] == ["0", "1", "0", "1"]
    assert {i["local_world_size"] for i in info} == {"2"}


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD"])
def test_local_ranks_follow_where_ray_put_each_rank(cluster: Cluster, strategy: str) -> None:
    # One node entry of 4 does not fit a 2-CPU node: Ray splits it over both nodes.
    with WorkerGroup(
        ResourcePool([2 * CPUS_PER_NODE], use_gpu=False),
        ClassWithInitArgs(Where),
        backend="ray",
        backend_options={"placement_strategy": strategy},
    ) as wg:
        info = wg.where()
    nodes = [i["node"] for i in info]
    assert len(set(nodes)) == 2
    for rank, item in enumerate(info):
        same = [r for r, n in enumerate(nodes) if n == item["node"]]
        assert item["local_rank"] == str(same.index(rank))
        assert item["local_world_size"] == str(len(same))


def test_node_entry_larger_than_any_node_fails_fast(cluster: Cluster) -> None:
    start = time.monotonic()
    with pytest.raises(ResourceUnavailableError, match="no single node"):
        WorkerGroup(
            ResourcePool([CPUS_PER_NODE + 1], use_gpu=False),
            ClassWithInitArgs(Where),
            backend="ray",
        )
    assert time.monotonic() - start < 10


CONTROLLER = textwrap.dedent(
    """
    import json, os
    from podium import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, register

    class MainWorker(Worker):  # defined in __main__: travels by value
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def hello(self):
            return self.rank * 10

    class Peer(Worker):  # the other controller's class, for the method table
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def where(self):
            ...

    wg = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(MainWorker), backend="ray",
                     name_prefix="from_subprocess")
    peer = WorkerGroup.attach("main_named", Peer, backend="ray")
    print(json.dumps({"hello": wg.hello(), "peer": [w["local_rank"] for w in peer.where()]}))
    os._exit(0)  # leave without shutting anything down
    """
)


def test_another_controller_attaches_and_its_exit_leaves_nothing(cluster: Cluster) -> None:
    pool = ResourcePool([1], use_gpu=False)
    with WorkerGroup(pool, ClassWithInitArgs(Where), backend="ray", name_prefix="main_named"):
        env = {**os.environ, "RAY_ADDRESS": cluster.address}
        proc = subprocess.run(
            [sys.executable, "-c", CONTROLLER], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result == {"hello": [0, 10], "peer": ["0"]}
        assert eventually(lambda: live_actor_names("from_subprocess") == [], timeout=30)
        assert eventually(
            lambda: len(live_placement_groups()) == 1, timeout=30
        )  # only this test's own
    assert live_placement_groups() == []


def test_autoscaling_option_waits_for_the_cluster_to_grow(cluster: Cluster) -> None:
    # No node holds 3 CPUs (a fixed cluster fails at once, see above); an autoscaling
    # one may add such a node: here the test adds it while the group waits.
    outcome: list[Any] = []

    def start() -> None:
        try:
            with WorkerGroup(
                ResourcePool([CPUS_PER_NODE + 1], use_gpu=False),
                ClassWithInitArgs(Where),
                backend="ray",
                backend_options={"autoscaling": True, "placement_timeout": 120.0},
            ) as wg:
                outcome.append(wg.where())
        except BaseException as exc:
            outcome.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    time.sleep(3)
    assert not outcome, outcome  # still waiting for a node that can hold it
    node = cluster.add_node(num_cpus=CPUS_PER_NODE + 1)  # (signals: main thread only)
    try:
        starter.join(timeout=150)
        assert len(outcome) == 1 and isinstance(outcome[0], list), outcome
        assert len({i["node"] for i in outcome[0]}) == 1 and len(outcome[0]) == CPUS_PER_NODE + 1
    finally:
        cluster.remove_node(node)
