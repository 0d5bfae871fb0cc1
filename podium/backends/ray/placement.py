"""Placement groups behind resource pools.

Each *root* pool gets one placement group per node entry (``[4, 4]`` -> two
groups of four bundles), created when the first group starts on the pool and
removed when the last one leaves. Split and merged pools address their root's
bundles through their slots, so they keep the root's GPUs. Placement groups
are sorted by node IP once ready; node entry ``k`` of the pool is the ``k``-th
of them, so ranks are ordered by node IP, then by bundle.

Before anything is created the demand is checked against the cluster's total
resources: a pool the cluster can never hold is an error at once, with demand
and supply; a pool that fits but finds the cluster busy waits up to
``placement_timeout`` and then raises the same error.
"""

from __future__ import annotations

import ipaddress
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from podium.core.resource import ResourcePool
from podium.errors import ResourceUnavailableError

__all__ = ["PoolPlacement", "RankPlace", "check_feasible", "demands_of", "reserve"]

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
_EPS = 1e-6
_lock = threading.Lock()
# The placement groups of each root pool, shared by every group on it. Owned
# here, not by the pool (a pure spec); an entry goes when its pool does.
_placements: weakref.WeakKeyDictionary[ResourcePool, PoolPlacement] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class NodeSupply:
    node_id: str
    ip: str
    resources: dict[str, float]


def alive_nodes() -> list[NodeSupply]:
    nodes = []
    for n in ray.nodes():
        if n.get("Alive"):
            res = {k: float(v) for k, v in n.get("Resources", {}).items() if k in ("CPU", "GPU")}
            nodes.append(NodeSupply(n["NodeID"], n["NodeManagerAddress"], res))
    return nodes


@dataclass(frozen=True)
class PGDemand:
    """One placement group a pool needs: ``count`` bundles of ``bundle`` on node entry ``node``."""

    pool: str
    node: int
    count: int
    bundle: dict[str, float]
    strategy: str

    def total(self) -> dict[str, float]:
        return {k: v * self.count for k, v in self.bundle.items()}

    def describe(self) -> str:
        return f"{self.pool}[node {self.node}]: {self.count} x {self.bundle} ({self.strategy})"


def bundle_of(pool: ResourcePool, cpus_per_worker: float) -> dict[str, float]:
    bundle = {"CPU": float(cpus_per_worker)}
    if pool.use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def demands_of(
    pools: Sequence[ResourcePool], cpus_per_worker: float, strategy: str
) -> list[PGDemand]:
    """The placement groups behind ``pools``, counting each root pool once."""
    roots: dict[int, ResourcePool] = {}
    for pool in pools:
        for slot in pool.slots:
            roots.setdefault(slot.root.uid, slot.root)
    out = []
    for root in roots.values():
        bundle = bundle_of(root, cpus_per_worker)
        for node, count in enumerate(root.store):
            out.append(PGDemand(root.name_prefix, node, count, bundle, strategy))
    return out


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + _EPS >= v for k, v in need.items())


def _sum(dicts: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _packable(
    demands: Sequence[PGDemand], nodes: Sequence[NodeSupply], budget: int = 20000
) -> bool:
    """Can every STRICT_PACK group sit whole on some node, all at once? (exact, bounded search)"""
    items = sorted(
        (d.total() for d in demands if d.strategy == "STRICT_PACK"),
        key=lambda t: (t.get("GPU", 0.0), t.get("CPU", 0.0)),
        reverse=True,
    )
    free = [dict(n.resources) for n in nodes]
    steps = 0

    def place(i: int) -> bool:
        nonlocal steps
        if i == len(items):
            return True
        tried: list[dict[str, float]] = []
        for cap in free:
            steps += 1
            if steps > budget:
                return True  # too large to decide here: let placement itself try
            if cap in tried or not _fits(items[i], cap):
                continue
            tried.append(dict(cap))
            for k, v in items[i].items():
                cap[k] -= v
            ok = place(i + 1)
            for k, v in items[i].items():
                cap[k] += v
            if ok:
                return True
        return False

    return place(0)


def check_feasible(demands: Sequence[PGDemand], nodes: Sequence[NodeSupply]) -> None:
    """Raise :class:`ResourceUnavailableError` when ``nodes`` can never hold ``demands``."""
    if not demands:
        return
    problems = []
    need = _sum([d.total() for d in demands])
    have = _sum([n.resources for n in nodes])
    for k, v in sorted(need.items()):
        if have.get(k, 0.0) + _EPS < v:
            problems.append(
                f"the pools need {v:g} {k} in all, the cluster has {have.get(k, 0.0):g}"
            )
    for d in demands:
        if d.strategy == "STRICT_PACK" and not any(_fits(d.total(), n.resources) for n in nodes):
            problems.append(
                f"no single node can hold {d.describe()} (STRICT_PACK puts a node entry on one node)"
            )
        elif (
            d.strategy == "STRICT_SPREAD"
            and sum(_fits(d.bundle, n.resources) for n in nodes) < d.count
        ):
            problems.append(
                f"fewer than {d.count} nodes can each hold a bundle {d.bundle} (STRICT_SPREAD)"
            )
        elif not any(_fits(d.bundle, n.resources) for n in nodes):
            problems.append(f"no node can hold one bundle {d.bundle}")
    if not problems and not _packable(demands, nodes):
        problems.append("the STRICT_PACK node entries cannot all be packed onto the nodes at once")
    if not problems:
        return
    demand = {"placement_groups": [d.describe() for d in demands], "total": need}
    supply = {"nodes": [{"ip": n.ip, **n.resources} for n in nodes], "total": have}
    hints = []
    if need.get("GPU", 0.0) > have.get("GPU", 0.0):
        hints.append(
            "use ResourcePool(..., use_gpu=False) for CPU workers, connect to a cluster with GPUs "
            "(backend_options address=... or RAY_ADDRESS), or start the local Ray with logical GPUs "
            "(backend_options num_gpus=N)"
        )
    if need.get("CPU", 0.0) > 0:
        hints.append(
            "lower backend_options cpus_per_worker, or give the local Ray more logical CPUs "
            "(backend_options num_cpus=N)"
        )
    hints.append("or use a smaller pool")
    raise ResourceUnavailableError(
        "the Ray cluster can never hold the requested pool(s): "
        + "; ".join(problems)
        + f". Demand: {demand}. Supply: {supply}. To fix: "
        + "; ".join(hints)
        + ".",
        demand=demand,
        supply=supply,
    )


def ip_sort_key(ip: str) -> tuple[int, Any]:
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


@dataclass
class PoolPlacement:
    """The placement groups of one root pool (node entry order), and who uses their bundles.

    Created in two steps so that nobody holds the module lock while Ray places
    the groups: ``_begin`` asks Ray for them (under the lock), ``_finish``
    waits for them and sets ``ready`` (outside it); others wait on ``ready``.
    """

    pgs: list[Any]
    ips: list[str]
    node_ids: list[str]
    job: str
    users: dict[tuple[int, int], int] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def remove(self) -> None:
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or Ray is gone
                pass
        self.pgs = []


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: bundle ``bundle`` of ``pg``, on node ``ip``."""

    pg: Any
    bundle: int
    ip: str
    node_id: str


def _begin(
    root: ResourcePool, cpus_per_worker: float, strategy: str, job: str, autoscaling: bool
) -> PoolPlacement:
    """Check the root pool fits the cluster and ask Ray for its placement groups (no waiting).

    An autoscaling cluster is not checked: it may add the nodes the pool needs.
    """
    demands = demands_of([root], cpus_per_worker, strategy)
    if not autoscaling:
        check_feasible(demands, alive_nodes())
    pgs = [
        placement_group(
            [dict(d.bundle) for _ in range(d.count)],
            strategy=strategy,
            name=f"podium:{root.name_prefix}:{d.node}",
        )
        for d in demands
    ]
    return PoolPlacement(pgs, [], [], job)


def _finish(
    placement: PoolPlacement,
    root: ResourcePool,
    cpus_per_worker: float,
    strategy: str,
    timeout: float,
) -> None:
    """Wait for ``placement``'s groups; order them by node IP. Raises (removing them) past ``timeout``."""
    pgs = placement.pgs
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout)
    if len(ready) < len(pgs):
        demands = demands_of([root], cpus_per_worker, strategy)
        avail = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        demand = {
            "placement_groups": [d.describe() for d in demands],
            "total": _sum([d.total() for d in demands]),
        }
        raise ResourceUnavailableError(
            f"pool {root.name_prefix!r} could not be placed within {timeout:g} s: other work holds "
            "the resources (or an autoscaling cluster did not add the nodes it needs in time). "
            f"Demand: {demand}. Available now: {avail}. Shut down groups you no longer need, or "
            "wait longer with backend_options placement_timeout=SECONDS.",
            demand=demand,
            supply={"available": avail},
        )
    ip_of = {n.node_id: n.ip for n in alive_nodes()}
    placed = []
    for i, pg in enumerate(pgs):
        node_id = placement_group_table(pg)["bundles_to_node_id"][0]
        placed.append((ip_sort_key(ip_of.get(node_id, "")), node_id, i, pg, ip_of.get(node_id, "")))
    placed.sort(key=lambda t: (t[0], t[1], t[2]))
    placement.pgs = [p[3] for p in placed]
    placement.ips = [p[4] for p in placed]
    placement.node_ids = [p[1] for p in placed]


def reserve(
    pool: ResourcePool,
    *,
    cpus_per_worker: float,
    strategy: str,
    timeout: float,
    autoscaling: bool = False,
) -> tuple[list[RankPlace], Any]:
    """Places for every rank of ``pool`` and a ``release()`` to call when the group is gone.

    Creates the root pools' placement groups on first use. Refuses (instead of
    hanging) a group that would put more than ``max_colocate_count`` groups on a slot.
    """
    job = ray.get_runtime_context().get_job_id()
    while True:
        with _lock:
            placements: dict[int, PoolPlacement] = {}
            roots: dict[int, ResourcePool] = {}
            mine: list[PoolPlacement] = []
            for slot in pool.slots:
                if slot.root.uid in placements:
                    continue
                placement: PoolPlacement | None = _placements.get(slot.root)
                if placement is None or placement.job != job or not placement.pgs:
                    try:
                        placement = _begin(slot.root, cpus_per_worker, strategy, job, autoscaling)
                    except BaseException as exc:
                        _abandon(mine, roots, exc)
                        raise
                    _placements[slot.root] = placement
                    mine.append(placement)
                placements[slot.root.uid] = placement
                roots[slot.root.uid] = slot.root
            if not mine and all(p.ready.is_set() for p in placements.values()):
                return _claim(pool, placements), _releaser(pool, placements)
        # Wait for Ray to place the groups without holding the lock, so other threads
        # can start and stop groups meanwhile; then look again under the lock.
        for uid, placed in placements.items():
            if placed in mine:
                try:
                    _finish(placed, roots[uid], cpus_per_worker, strategy, timeout)
                except BaseException as exc:
                    with _lock:
                        _abandon([p for p in mine if not p.ready.is_set()], roots, exc)
                    raise
                placed.ready.set()
            elif not placed.ready.wait(timeout) or placed.error is not None:
                if placed.error is not None:
                    raise placed.error
                raise ResourceUnavailableError(
                    f"pool {roots[uid].name_prefix!r} is still being placed by another thread after "
                    f"{timeout:g} s. Wait longer with backend_options placement_timeout=SECONDS.",
                )


def _abandon(
    placements: list[PoolPlacement], roots: dict[int, ResourcePool], exc: BaseException
) -> None:
    """Placements this thread began and cannot finish: remove them, fail their waiters (under the lock)."""
    for root in roots.values():
        if _placements.get(root) in placements:
            del _placements[root]
    for placement in placements:
        placement.remove()
        placement.error = exc
        placement.ready.set()


def _claim(pool: ResourcePool, placements: dict[int, PoolPlacement]) -> list[RankPlace]:
    """Count ``pool``'s group as a user of its slots (under the lock); its places, rank by rank.

    Refuses (instead of hanging) a group that would put more than
    ``max_colocate_count`` groups on a slot.
    """
    for slot in pool.slots:
        used = placements[slot.root.uid].users.get((slot.node, slot.local), 0)
        if used >= pool.max_colocate_count:
            raise ResourceUnavailableError(
                f"slot (node {slot.node}, index {slot.local}) of pool {slot.root.name_prefix!r} "
                f"already hosts {used} group(s) and the pool's max_colocate_count is "
                f"{pool.max_colocate_count}. Shut a group down first, or build the pool with a "
                "larger max_colocate_count.",
                demand={"groups_on_slot": used + 1},
                supply={"max_colocate_count": pool.max_colocate_count},
            )
    places = []
    for slot in pool.slots:
        placement = placements[slot.root.uid]
        key = (slot.node, slot.local)
        placement.users[key] = placement.users.get(key, 0) + 1
        places.append(
            RankPlace(
                placement.pgs[slot.node],
                slot.local,
                placement.ips[slot.node],
                placement.node_ids[slot.node],
            )
        )
    return places


def _releaser(pool: ResourcePool, placements: dict[int, PoolPlacement]) -> Any:
    released = False

    def release() -> None:
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            for slot in pool.slots:
                placement = placements[slot.root.uid]
                key = (slot.node, slot.local)
                placement.users[key] = placement.users.get(key, 1) - 1
                if placement.users[key] <= 0:
                    del placement.users[key]
            for placement in placements.values():
                if not placement.users:
                    placement.remove()

    return release
