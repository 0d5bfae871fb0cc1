"""The inline backend: every rank is an object in the controller process.

No processes, no process group, no per-rank environment; breakpoints work.
For debugging and fast unit tests. Each rank receives its own copy of every
argument, and the controller a copy of every result, made by pickling as a
process boundary would, so code behaves here as it does on process backends.
Calls run when they are submitted, one rank after another.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from podium.core.backend import Backend, BackendGroup, Capabilities, GroupSpec, RankCall
from podium.core.futures import RankFuture
from podium.core.host import Outcome, WorkerHost
from podium.core.serialization import copy_via_pickle
from podium.core.worker import RankInfo

__all__ = ["InlineBackend"]


class InlineFuture(RankFuture):
    def __init__(self, rank: int, method: str, outcome: Outcome) -> None:
        super().__init__(rank, method)
        self._outcome = outcome

    def result(self, timeout: float | None = None) -> Any:
        return self._outcome.unwrap()

    def done(self) -> bool:
        return True


class InlineGroup(BackendGroup):
    def __init__(self, spec: GroupSpec) -> None:
        pool = spec.pool
        self.world_size = pool.world_size
        self.worker_names = [f"{spec.name_prefix}_{rank}" for rank in range(self.world_size)]
        local_ws = pool.local_world_size_list()
        local_rank = pool.local_rank_list()
        node_of = [slot.node for slot in pool.slots]
        self._env = _apply_env(spec.worker_env)
        self._hosts: list[WorkerHost] = []
        for rank in range(self.world_size):
            info = RankInfo(rank, self.world_size, local_rank[rank], local_ws[rank], node_rank=node_of[rank])
            host, outcome = WorkerHost.start(info, copy_via_pickle(spec.cls_with_init))
            if host is None:
                self._shutdown()
                outcome.unwrap()
                return
            self._hosts.append(host)

    def submit(self, target: str, calls: Sequence[RankCall], *, timeout: float | None = None) -> list[RankFuture]:
        if getattr(self, "_podium_closed", False):
            raise RuntimeError("this worker group was shut down")
        futures: list[RankFuture] = []
        for call in calls:
            args, kwargs = copy_via_pickle((call.args, call.kwargs))
            outcome = self._hosts[call.rank].run(target, args, kwargs)
            if outcome.ok:
                outcome = Outcome(True, copy_via_pickle(outcome.value))
            futures.append(InlineFuture(call.rank, target, outcome))
        return futures

    def _shutdown(self) -> None:
        for host in self._hosts:
            host.close()
        self._hosts = []
        for key, old in self._env.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _apply_env(worker_env: dict[str, str] | Any) -> dict[str, str | None]:
    """Inline ranks share the controller's environment: worker_env is set there for the group's life."""
    saved: dict[str, str | None] = {}
    for key, value in worker_env.items():
        current = os.environ.get(key)
        if current is not None and current != value:
            raise ValueError(
                f"worker_env sets {key}={value!r}, but the controller (which the inline backend runs "
                f"every rank in) already has {key}={current!r}"
            )
        saved[key] = current
        os.environ[key] = value
    return saved


class InlineBackend(Backend):
    name = "inline"
    capabilities = Capabilities(fractional_colocation=True)
    options = ()

    def _start_group(self, spec: GroupSpec) -> BackendGroup:
        return InlineGroup(spec)
