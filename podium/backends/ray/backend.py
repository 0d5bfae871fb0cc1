"""The Ray backend: pools become placement groups, ranks become actors.

Connection: an already initialized Ray is used as it is; otherwise
``backend_options["address"]`` or ``RAY_ADDRESS`` is connected to; otherwise a
local Ray is started for the user (token authentication stays on, as Ray sets
it). That local Ray is given at least ``LOCAL_MIN_CPUS`` logical CPUs, because
CPU workers on one host are routinely oversubscribed (tests run eight CPU
workers on two cores); a cluster podium did not start is taken as it is.

Each actor takes ``1 / max_colocate_count`` of its bundle (CPUs and GPU), so
as many groups as the pool allows share its slots, and Ray gives each rank its
own ``CUDA_VISIBLE_DEVICES``. Actors are named ``{name_prefix}_{rank}`` in the
backend's namespace, which is how ``WorkerGroup.attach`` finds them.

A group stops gracefully (see :mod:`podium.backends.ray.group`): each rank runs
its worker's ``shutdown()`` hook and exits normally, and is killed only after
``stop_timeout``. A cluster that grows on demand (``autoscaling=True``) skips
the "can this cluster ever hold the pool" check and waits ``placement_timeout``.
"""

from __future__ import annotations

import functools
import gc
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from podium.backends.ray import reaper, wire
from podium.backends.ray.actor import actor_class
from podium.backends.ray.futures import RayRankFuture, decode_outcome, died_error
from podium.backends.ray.group import SHARE_BY_REF_BYTES, RayGroup, finish_dropped_stops
from podium.backends.ray.placement import (
    STRATEGIES,
    alive_nodes,
    check_feasible,
    demands_of,
    ip_sort_key,
    reserve,
)
from podium.core.backend import (
    BACKEND_NAME_ENV,
    PREFIX_ENV,
    Backend,
    BackendOption,
    Capabilities,
    GroupSpec,
)
from podium.core.host import has_async_methods, is_async_target, max_async_calls
from podium.core.resource import ResourcePool
from podium.core.worker import ClassWithInitArgs, RankInfo, colocated_roles
from podium.core.worker_group import registered_methods
from podium.errors import (
    CallTimeoutError,
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerStartupError,
)

__all__ = ["RayBackend"]

LOCAL_MIN_CPUS = 64
LOCAL_GCS_RECONNECT_S = 5
_GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
# Ray starts its workers at niceness 15 by default; podium's are the job, not background work.
_WORKER_NICENESS_ENV = "RAY_worker_niceness"
# PyTorch's CPU allocator puts tensors of 2 MiB and more in transparent huge pages.
_TORCH_THP_ENV = "THP_MEM_ALLOC_ENABLE"


class RayBackend(Backend):
    """Ray actors in placement groups, data through the object store."""

    name = "ray"
    capabilities = Capabilities(
        process_group=True,
        multi_node=True,
        gpu=True,
        fractional_colocation=True,
        named_workers=True,
        worker_to_worker_futures=True,
        call_timeout=True,
        detects_dead_workers=True,
        worker_env=True,
        batch_refs=True,
        concurrent_async_calls=True,
    )
    options = (
        BackendOption(
            "address",
            str,
            None,
            "Ray cluster to connect to (default: $RAY_ADDRESS, else start a local Ray)",
        ),
        BackendOption(
            "num_cpus",
            int,
            None,
            f"logical CPUs of a local Ray podium starts (default: max(cores, {LOCAL_MIN_CPUS}))",
        ),
        BackendOption(
            "num_gpus", int, None, "logical GPUs of a local Ray podium starts (default: detected)"
        ),
        BackendOption("namespace", str, "podium", "Ray namespace of the named worker actors"),
        BackendOption(
            "placement_strategy",
            str,
            "STRICT_PACK",
            f"placement group strategy per node entry: {', '.join(STRATEGIES)}",
        ),
        BackendOption("cpus_per_worker", (int, float), 1, "CPUs in each pool slot's bundle"),
        BackendOption(
            "placement_timeout",
            (int, float),
            60.0,
            "seconds to wait for a busy cluster to free a pool's resources",
        ),
        BackendOption(
            "autoscaling",
            bool,
            False,
            "the cluster grows to fit pending work (Ray autoscaler): a pool larger than the nodes "
            "running now waits up to placement_timeout for new nodes instead of failing at once",
        ),
        BackendOption(
            "startup_timeout",
            (int, float),
            300.0,
            "seconds for every rank's process and constructor to start",
        ),
        BackendOption(
            "stop_timeout",
            (int, float),
            10.0,
            "seconds a stopping group waits for each rank's shutdown() hook and exit before "
            "killing it",
        ),
        BackendOption(
            "runtime_env",
            dict,
            None,
            "Ray runtime_env for the worker actors (worker_env is merged into env_vars)",
        ),
        BackendOption(
            "init_kwargs",
            dict,
            None,
            "extra ray.init() arguments (default include_dashboard=False)",
        ),
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        cfg = self.config
        if cfg["placement_strategy"] not in STRATEGIES:
            raise ValueError(
                f"backend option placement_strategy must be one of {STRATEGIES}, got {cfg['placement_strategy']!r}"
            )
        for key in ("cpus_per_worker", "placement_timeout", "startup_timeout", "stop_timeout"):
            if cfg[key] <= 0:
                raise ValueError(f"backend option {key} must be > 0, got {cfg[key]!r}")
        self._started_ray = False
        self._groups: weakref.WeakSet[RayGroup] = weakref.WeakSet()

    # -- cluster -------------------------------------------------------------

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"include_dashboard": False, **(self.config["init_kwargs"] or {})}
        address = self.config["address"] or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, **kwargs)
            return
        kwargs.setdefault(
            "num_cpus", self.config["num_cpus"] or max(os.cpu_count() or 1, LOCAL_MIN_CPUS)
        )
        if self.config["num_gpus"] is not None:
            kwargs.setdefault("num_gpus", self.config["num_gpus"])
        # Ray's agents (dashboard agent, runtime-env agent) of a local Ray outlive a
        # killed controller until they give up reconnecting to its dead GCS, 60 s by
        # default; nothing can reconnect to a Ray whose owner is gone, so they give up
        # sooner, and a watcher kills what is left (see podium.backends.ray.reaper).
        # Both are environment variables of the processes Ray starts, so they are set
        # only while ray.init starts them.
        # Ray also starts its workers at niceness 15, below the controller and below a
        # torchrun worker: on a busy host they get a fraction of the CPU. A local Ray
        # podium starts runs them at the controller's own priority.
        # A rank's new tensors -- a method's result, the rows it was sent -- are fresh
        # memory on every call; in 4 KiB pages the page faults cost more than the bytes
        # (a 64 MiB DP round trip took twice raw Ray's time). PyTorch's own switch puts
        # its large CPU tensors in huge pages, as numpy does for its arrays.
        env = {
            _GCS_RECONNECT_ENV: str(LOCAL_GCS_RECONNECT_S),
            _WORKER_NICENESS_ENV: "0",
            _TORCH_THP_ENV: "1",
            **reaper.start_watcher(),
        }
        for user_set in (_GCS_RECONNECT_ENV, _WORKER_NICENESS_ENV, _TORCH_THP_ENV):
            if user_set in os.environ:
                del env[user_set]  # the user's own setting wins
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            # "local": a new instance, even where `ray start` left a cluster address on
            # this host (Ray would connect to that one and refuse num_cpus).
            ray.init(**{"address": "local", **kwargs})
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self._started_ray = True

    def worker_import_env(self, spec: GroupSpec) -> Mapping[str, str]:
        """A local Ray podium started inherits this process's environment; the workers of a
        cluster it attached to start with the cluster's, so the controller's ``PYTHONPATH``
        counts only where ``worker_env`` or ``runtime_env`` passes it on."""
        self._connect()
        env = dict(spec.worker_env)
        runtime_vars = (self.config["runtime_env"] or {}).get("env_vars", {})
        if not self._started_ray and "PYTHONPATH" not in env:
            env["PYTHONPATH"] = runtime_vars.get("PYTHONPATH", "")
        return env

    def check_resources(self, pools: Sequence[ResourcePool]) -> None:
        self._connect()
        if self.config["autoscaling"]:
            return  # the nodes running now say nothing about the nodes the cluster may add
        check_feasible(
            demands_of(
                pools, float(self.config["cpus_per_worker"]), self.config["placement_strategy"]
            ),
            alive_nodes(),
        )

    # -- groups --------------------------------------------------------------

    def _start_group(self, spec: GroupSpec) -> RayGroup:
        self._connect()
        pool = spec.pool
        places, release = self._reserve(pool)
        deadline = time.monotonic() + float(self.config["startup_timeout"])
        actors: list[Any] = []
        names = [f"{spec.name_prefix}_{rank}" for rank in range(pool.world_size)]
        try:
            share = 1.0 / pool.max_colocate_count
            base: dict[str, Any] = {
                "num_cpus": float(self.config["cpus_per_worker"]) * share,
                "num_gpus": share if pool.use_gpu else 0,
                "namespace": self.config["namespace"],
                "max_concurrency": 1,
            }
            # The group's own names (WG_PREFIX, WG_BACKEND) are set by setup() below, like
            # the rank variables: in runtime_env they would make each group's env distinct.
            runtime_env = _runtime_env(
                self.config["runtime_env"],
                {k: v for k, v in spec.worker_env.items() if k not in _GROUP_ENV},
            )
            if runtime_env:
                base["runtime_env"] = runtime_env
            overlap = has_async_methods(spec.cls_with_init)
            rank_actor = actor_class(
                _targets(spec.cls_with_init),
                max_async_calls(spec.cls_with_init.cls) if overlap else 0,
            )
            for rank, place in enumerate(places):
                strategy = PlacementGroupSchedulingStrategy(
                    place.pg,
                    placement_group_bundle_index=place.bundle,
                    placement_group_capture_child_tasks=False,
                )
                try:
                    actors.append(
                        rank_actor.options(
                            name=names[rank], scheduling_strategy=strategy, **base
                        ).remote()
                    )
                except ValueError as exc:
                    if "already" in str(exc):
                        raise ValueError(
                            f"worker name {names[rank]!r} is taken in Ray namespace {self.config['namespace']!r}: "
                            "another group with this name_prefix is running. Choose another name_prefix, "
                            "or reach the running group with WorkerGroup.attach()."
                        ) from None
                    raise
            where = self._wait_start(
                [a.where.remote() for a in actors], list(range(len(actors))), deadline
            )
            ip, port = where[0][0], where[0][1]
            if self.config["placement_strategy"] == "STRICT_PACK":
                # Each node entry is one placement group on one node: the layout is the truth.
                local_ranks = pool.local_rank_list()
                local_sizes = pool.local_world_size_list()
                node_ranks = [n for n, count in enumerate(pool.store) for _ in range(count)]
            else:
                # PACK/SPREAD put a node entry's bundles where Ray finds room: ask each rank.
                local_ranks, local_sizes, node_ranks = _actual_layout([(w[0], w[4]) for w in where])
            cls_payload: Any = wire.encode(spec.cls_with_init)
            if wire.payload_nbytes(cls_payload) > SHARE_BY_REF_BYTES:
                cls_payload = ray.put(cls_payload)  # large constructor arguments: stored once
            refs = []
            for rank, actor in enumerate(actors):
                info = RankInfo(
                    rank=rank,
                    world_size=pool.world_size,
                    local_rank=local_ranks[rank],
                    local_world_size=local_sizes[rank],
                    node_rank=node_ranks[rank],
                    master_addr=ip,
                    master_port=port,
                )
                env = {
                    **spec.worker_env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(pool.world_size),
                    "LOCAL_RANK": str(local_ranks[rank]),
                    "LOCAL_WORLD_SIZE": str(local_sizes[rank]),
                    "MASTER_ADDR": ip,
                    "MASTER_PORT": str(port),
                    # verl's utilities read these on Ray.
                    "RAY_LOCAL_RANK": str(local_ranks[rank]),
                    "RAY_LOCAL_WORLD_SIZE": str(local_sizes[rank]),
                }
                refs.append(actor.setup.remote(info, env, cls_payload))
            for payload in self._wait_start(refs, list(range(len(actors))), deadline):
                decode_outcome(payload).unwrap()  # a failing user constructor raises here, as itself
        except BaseException:
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass
            release()
            raise
        group = RayGroup(
            actors,
            names,
            owner=True,
            release=release,
            pids=[w[2] for w in where],
            hosts=[w[0] for w in where],
            log_paths=[w[3] for w in where],
            nodes=[w[4] for w in where],
            stop_timeout=float(self.config["stop_timeout"]),
            is_async=functools.partial(is_async_target, spec.cls_with_init) if overlap else None,
            places=[(place.pg, place.bundle) for place in places],
        )
        self._groups.add(group)
        return group

    def _reserve(self, pool: ResourcePool) -> tuple[list[Any], Any]:
        """``reserve`` the pool's slots; a slot held by a group that was dropped but not yet
        collected or stopped is freed first (collect garbage, wait for the stop), then retried."""

        def attempt() -> tuple[list[Any], Any]:
            return reserve(
                pool,
                cpus_per_worker=float(self.config["cpus_per_worker"]),
                strategy=self.config["placement_strategy"],
                timeout=float(self.config["placement_timeout"]),
                autoscaling=bool(self.config["autoscaling"]),
            )

        finish_dropped_stops(float(self.config["stop_timeout"]) + 5.0)
        try:
            return attempt()
        except ResourceUnavailableError as exc:
            if "groups_on_slot" not in (exc.demand or {}):
                raise
        gc.collect()  # a dropped WorkerGroup in a reference cycle still holds its slot
        finish_dropped_stops(float(self.config["stop_timeout"]) + 5.0)
        return attempt()

    def _wait_start(self, refs: list[Any], ranks: list[int], deadline: float) -> list[Any]:
        """Raw results of start-up calls; a rank that cannot start is a WorkerStartupError."""
        futures = [RayRankFuture(ref, rank, "__start__") for ref, rank in zip(refs, ranks)]
        timeout = max(0.0, deadline - time.monotonic())
        try:
            _gather_raw(futures, timeout)
        except CallTimeoutError as exc:
            raise WorkerStartupError(
                f"ranks {exc.ranks} did not start within startup_timeout={self.config['startup_timeout']:g} s "
                "(their actors are still pending: the cluster may lack resources, or a runtime_env is slow "
                "to build). Raise backend_options startup_timeout=SECONDS if this is expected.",
                rank=exc.ranks[0] if exc.ranks else None,
            ) from None
        except WorkerDiedError as exc:
            raise WorkerStartupError(
                f"rank {exc.rank} could not start: {exc}", rank=exc.rank
            ) from None
        return [ray.get(r) for r in refs]

    def attach_group(self, name_prefix: str) -> RayGroup:
        self._connect()
        namespace = self.config["namespace"]
        # Look the ranks' names up directly (rank 0, 1, ... until one is missing).
        actors: list[Any] = []
        names: list[str] = []
        while True:
            name = f"{name_prefix}_{len(actors)}"
            try:
                actors.append(ray.get_actor(name, namespace=namespace))
            except ValueError:
                break
            names.append(name)
        if not actors:
            prefixes = sorted(
                {
                    e["name"].rsplit("_", 1)[0]
                    for e in ray.util.list_named_actors(all_namespaces=True)
                    if e["namespace"] == namespace
                }
            )
            raise LookupError(
                f"no running podium group named {name_prefix!r} in Ray namespace {namespace!r} "
                f"(no worker {name_prefix}_0). Running groups there: {prefixes or 'none'}. "
                "Pass the name_prefix the group was started with, and the same backend_options namespace."
            )
        where = ray.get(
            [a.where.remote() for a in actors], timeout=float(self.config["startup_timeout"])
        )
        return RayGroup(
            actors,
            names,
            owner=False,
            pids=[w[2] for w in where],
            hosts=[w[0] for w in where],
            log_paths=[w[3] for w in where],
        )

    def _shutdown(self) -> None:
        for group in list(self._groups):
            group.shutdown()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            reaper.stop_watchers()


def _gather_raw(futures: list[RayRankFuture], timeout: float) -> None:
    """Wait for start-up calls; a rank whose actor died fails the wait at once
    (``ray.get`` raises as soon as one of the objects is an error)."""
    rank_of = {f.ref: f.rank for f in futures}
    try:
        ray.get(list(rank_of), timeout=timeout)
    except GetTimeoutError:
        ready, pending = ray.wait(list(rank_of), num_returns=len(rank_of), timeout=0)
        raise CallTimeoutError(futures[0].method, timeout, [rank_of[r] for r in pending]) from None
    except Exception:
        ready, _ = ray.wait(list(rank_of), num_returns=len(rank_of), timeout=0)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:
                raise died_error(rank_of[ref], exc) from None
        raise


def _actual_layout(nodes: list[tuple[str, str]]) -> tuple[list[int], list[int], list[int]]:
    """LOCAL_RANK, LOCAL_WORLD_SIZE and node rank of each rank from the (ip, node id) it runs on.

    Nodes are numbered by IP (node id breaks ties), as the pool's node entries
    are; ranks on one node are numbered in rank order.
    """
    order = {
        n: i for i, n in enumerate(sorted(set(nodes), key=lambda n: (ip_sort_key(n[0]), n[1])))
    }
    seen: dict[tuple[str, str], int] = {}
    local_ranks = []
    for node in nodes:
        local_ranks.append(seen.get(node, 0))
        seen[node] = local_ranks[-1] + 1
    return local_ranks, [seen[n] for n in nodes], [order[n] for n in nodes]


_GROUP_ENV = (PREFIX_ENV, BACKEND_NAME_ENV)


def _runtime_env(base: dict[str, Any] | None, worker_env: dict[str, str] | Any) -> dict[str, Any]:
    env = dict(base or {})
    if worker_env:
        env["env_vars"] = {**env.get("env_vars", {}), **dict(worker_env)}
    return env


def _targets(cwa: ClassWithInitArgs[Any]) -> set[str]:
    """The ``@register``-ed targets of a worker class (``role:method`` for colocated roles)."""
    roles = colocated_roles(cwa)
    if roles is not None:
        return {f"{role}:{name}" for role, sub in roles.items() for name in registered_methods(sub.cls)}
    return set(registered_methods(cwa.cls))

