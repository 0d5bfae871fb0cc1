"""One running group on Ray: an actor per rank, and how calls reach them."""

from __future__ import annotations

import copy
import glob
import os
import time
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import ray

from podium.backends.ray import wire
from podium.backends.ray.actor import method_name
from podium.backends.ray.futures import RayRankFuture, died_error
from podium.core.backend import BackendGroup, RankCall
from podium.core.futures import RankFuture
from podium.errors import WorkerDiedError

__all__ = ["RayGroup"]

# Above this size a value several ranks share goes into the object store once
# (Ray inlines smaller call arguments into each task anyway).
SHARE_BY_REF_BYTES = 100 * 1024
# Values too small to be worth sharing by reference even when identical.
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


class RayGroup(BackendGroup):
    """The actors of one group, in rank order.

    ``owner`` is False for a group reached with ``attach``: shutting it down then
    only drops the handles; the controller that started it owns the actors.
    """

    def __init__(
        self,
        actors: list[Any],
        worker_names: list[str],
        *,
        owner: bool,
        release: Callable[[], None] | None = None,
        pids: list[int] | None = None,
        hosts: list[str] | None = None,
    ) -> None:
        self._actors = actors
        self.world_size = len(actors)
        self.worker_names = list(worker_names)
        self._owner = owner
        self._release = release
        self._dead: WorkerDiedError | None = None
        self._methods: dict[tuple[int, str], Any] = {}
        self.pids = list(pids or [])
        self.hosts = list(hosts or [])

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def submit(
        self, target: str, calls: Sequence[RankCall], *, timeout: float | None = None
    ) -> list[RankFuture]:
        if getattr(self, "_podium_closed", False):
            raise RuntimeError(f"this Ray worker group ({self.worker_names[:1]}...) was shut down")
        if self._dead is not None:
            raise copy.copy(self._dead)
        for call in calls:
            if not 0 <= call.rank < self.world_size:
                raise ValueError(
                    f"rank {call.rank} is out of range for a group of {self.world_size}"
                )
        deadline = None if timeout is None else time.monotonic() + timeout
        shared = self._share(calls)
        entries = [entry for _, entry in sorted(shared.values(), key=lambda t: t[0])]
        futures: list[RankFuture] = []
        for call in calls:
            used: list[int] = []  # indices into `entries` this call needs, in placeholder order
            args = tuple(_swap(a, shared, used) for a in call.args)
            kwargs = {k: _swap(v, shared, used) for k, v in call.kwargs.items()}
            method = self._method(call.rank, target)
            extra = [entries[k] for k in used]
            if method is None:
                ref = self._actors[call.rank].call.remote(
                    wire.encode((target, args, kwargs)), *extra
                )
            elif args or kwargs:
                ref = method.remote(wire.encode((args, kwargs)), *extra)
            else:
                ref = method.remote()
            futures.append(
                RayRankFuture(
                    ref,
                    call.rank,
                    target,
                    deadline=deadline,
                    timeout=timeout,
                    on_died=self._died,
                )
            )
        return futures

    def _method(self, rank: int, target: str) -> Any:
        """The rank's own actor method for ``target``, or None to go through ``call``."""
        key = (rank, target)
        if key not in self._methods:
            try:
                self._methods[key] = getattr(self._actors[rank], method_name(target))
            except AttributeError:
                self._methods[key] = None
        return self._methods[key]

    @staticmethod
    def _share(calls: Sequence[RankCall]) -> dict[int, tuple[int, Any]]:
        """id(value) -> (index, payload or ObjectRef) for values several ranks receive by identity.

        nd-mesh dispatch hands every TP/PP peer of a DP replica the same shard
        object: it is encoded once and, when large, put in the object store once.
        """
        if len(calls) < 2:
            return {}
        counts: dict[int, int] = {}
        objects: dict[int, Any] = {}
        for call in calls:
            for value in chain(call.args, call.kwargs.values()):
                if isinstance(value, _SCALARS):
                    continue
                counts[id(value)] = counts.get(id(value), 0) + 1
                objects[id(value)] = value
        shared: dict[int, tuple[int, Any]] = {}
        for key, n in counts.items():
            if n < 2:
                continue
            payload = wire.encode(objects[key])
            entry = (
                ray.put(payload) if wire.payload_nbytes(payload) > SHARE_BY_REF_BYTES else payload
            )
            shared[key] = (len(shared), entry)
        return shared

    def _died(self, rank: int, exc: BaseException) -> WorkerDiedError:
        """The error for ``rank``'s death (with its log tail); the group is unusable from now on."""
        pid = self.pids[rank] if rank < len(self.pids) else None
        local = rank < len(self.hosts) and self.hosts[rank] == ray.util.get_node_ip_address()
        err = died_error(rank, exc, pid=pid, log_tail=worker_log_tail(pid) if local else "")
        if self._dead is None:
            self._dead = err
        return err

    def _shutdown(self) -> None:
        if self._owner:
            for actor in self._actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already dead, or Ray is gone
                    pass
        if self._release is not None:
            try:
                self._release()
            except Exception:  # Ray is gone: its placement groups went with it
                pass
        self._actors = []
        self._methods.clear()


def _swap(value: Any, shared: dict[int, tuple[int, Any]], used: list[int]) -> Any:
    """``value``, or a placeholder for it when it is shared (recording which entry the call needs)."""
    found = shared.get(id(value))
    if found is None:
        return value
    key = found[0]
    if key not in used:
        used.append(key)
    return wire.Shared(used.index(key))


def worker_log_tail(pid: int | None, lines: int = 20) -> str:
    """The last lines of a worker's stderr/stdout logs, when they are on this host (else "")."""
    if pid is None:
        return ""
    try:
        node = ray._private.worker._global_node
        log_dir = node.get_logs_dir_path() if node is not None else None
    except Exception:  # Ray internals moved: the log tail is a convenience
        return ""
    if not log_dir:
        return ""
    out = []
    for path in sorted(glob.glob(os.path.join(log_dir, f"worker-*-{pid}.err"))) + sorted(
        glob.glob(os.path.join(log_dir, f"worker-*-{pid}.out"))
    ):
        try:
            with open(path, errors="replace") as f:
                # Ray's own marker lines (":job_id:...", ":actor_name:...") say nothing here.
                text = [ln.rstrip() for ln in f if ln.strip() and not ln.startswith(":")]
            tail = text[-lines:]
        except OSError:
            continue
        if tail:
            out.append(f"[{os.path.basename(path)}]\n" + "\n".join(tail))
    return "\n".join(out)
