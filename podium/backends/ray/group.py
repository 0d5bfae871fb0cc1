"""One running group on Ray: an actor per rank, how calls reach them, and how they stop.

Stopping (``shutdown()``, the group dropped without one, or the controller
exiting) is the same sequence every time:

1. calls still queued or running are cancelled (``ray.cancel``): Ray drops the
   queued ones; one already running on a rank runs to its end (Ray cannot
   interrupt a sync actor's call) and its result is discarded; their callers
   get :class:`podium.errors.GroupShutdownError` at once;
2. every rank runs its worker's ``shutdown()`` hook and exits its process
   normally (``ray.actor.exit_actor``), so ``atexit`` handlers run;
3. after ``stop_timeout`` seconds at most, ranks still alive are killed
   (``ray.kill``), then the group's share of the placement groups is released.

A group dropped without ``shutdown()`` is stopped on a background thread when
it is garbage collected (a finalizer holds only the actors and the release,
never the group); groups still alive when the controller exits are stopped
before Ray itself shuts down.
"""

from __future__ import annotations

import atexit
import copy
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from podium.backends.ray import wire
from podium.backends.ray.actor import ASYNC_GROUP, method_name
from podium.backends.ray.futures import RayRankFuture, died_error
from podium.core.backend import BackendGroup, RankCall
from podium.core.futures import RankFuture
from podium.errors import GroupShutdownError, PodiumError, WorkerDiedError

__all__ = ["RayGroup", "RayHandles"]

# Above this size a value several ranks share goes into the object store once
# (Ray inlines smaller call arguments into each task anyway).
SHARE_BY_REF_BYTES = 100 * 1024
# Values too small to be worth sharing by reference even when identical.
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


@dataclass(frozen=True)
class RayHandles:
    """``WorkerGroup.backend_handles`` on Ray: what each rank is, in rank order.

    The actors run podium's rank shell around the user's worker (their methods
    are podium's, not the worker's); use them to place other actors beside
    the ranks, to read where they run, or to kill one. Placement groups and
    bundle indices are empty for a group reached with ``WorkerGroup.attach``.
    """

    actors: list[Any]
    """Each rank's ``ray.actor.ActorHandle``."""
    placement_groups: list[Any]
    """Each rank's ``ray.util.placement_group.PlacementGroup`` (shared by the groups on one pool)."""
    bundle_indices: list[int]
    """Each rank's bundle in its placement group."""
    node_ids: list[str]
    """The Ray node id of each rank."""
    pids: list[int]
    """Each rank's process id (on its node)."""


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
        log_paths: list[str] | None = None,
        nodes: list[str] | None = None,
        stop_timeout: float = 10.0,
        is_async: Callable[[str], bool] | None = None,
        places: list[tuple[Any, int]] | None = None,
    ) -> None:
        self._actors = actors
        self._places = list(places or [])
        self._nodes = list(nodes or [])
        # Targets that run in the actor's ASYNC_GROUP threads (see actor_class).
        self._is_async = is_async or (lambda target: False)
        self.world_size = len(actors)
        self.worker_names = list(worker_names)
        self.name = worker_names[0].rsplit("_", 1)[0] if worker_names else "?"
        self._owner = owner
        self._release = release
        self._dead: WorkerDiedError | None = None
        self._methods: dict[tuple[int, str], Any] = {}
        self.pids = list(pids or [])
        self.hosts = list(hosts or [])
        self.log_paths = list(log_paths or [])
        self.closed = False
        self.stop_timeout = stop_timeout
        # Futures of calls not known to be finished, to cancel when the group stops.
        self._inflight: weakref.WeakSet[RayRankFuture] = weakref.WeakSet()
        # Holds no reference to the group, so a dropped group is collected and stopped.
        self._finalizer = weakref.finalize(
            self,
            _stop_in_background,
            list(actors) if owner else [],
            list(zip(nodes or [], pids or [])) if owner else [],
            self._inflight,
            release,
            stop_timeout,
        )
        self._finalizer.atexit = False  # the controller's exit stops live groups itself
        _live.add(self)

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def handles(self) -> RayHandles:
        return RayHandles(
            actors=list(self._actors),
            placement_groups=[pg for pg, _ in self._places],
            bundle_indices=[bundle for _, bundle in self._places],
            node_ids=list(self._nodes),
            pids=list(self.pids),
        )

    def submit(
        self, target: str, calls: Sequence[RankCall], *, timeout: float | None = None
    ) -> list[RankFuture]:
        if self.closed:
            raise GroupShutdownError(self.name, method=target)
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
        # A call with a deadline carries it (wall-clock): a rank skips the call if it
        # starts too late, i.e. it was queued behind a call that timed out.
        late = {} if timeout is None else {"deadline": time.time() + timeout}
        futures: list[RankFuture] = []
        for call in calls:
            used: list[int] = []  # indices into `entries` this call needs, in placeholder order
            args = tuple(_swap(a, shared, used) for a in call.args)
            kwargs = {k: _swap(v, shared, used) for k, v in call.kwargs.items()}
            method = self._method(call.rank, target)
            extra = [entries[k] for k in used]
            if method is None:
                generic = self._actors[call.rank].call
                if self._is_async(target):
                    generic = generic.options(concurrency_group=ASYNC_GROUP)
                ref = generic.remote(wire.encode((target, args, kwargs)), *extra, **late)
            elif args or kwargs or late:
                message = wire.encode((args, kwargs)) if args or kwargs else None
                ref = method.remote(message, *extra, **late)
            else:
                ref = method.remote()
            futures.append(
                RayRankFuture(
                    ref,
                    call.rank,
                    target,
                    deadline=deadline,
                    timeout=timeout,
                    group=self,
                )
            )
        self._inflight.update(futures)  # type: ignore[arg-type]
        return futures

    def _method(self, rank: int, target: str) -> Any:
        """The rank's own actor method for ``target``, or None to go through ``call``."""
        key = (rank, target)
        if key not in self._methods:
            try:
                method = getattr(self._actors[rank], method_name(target))
            except AttributeError:
                method = None
            if method is not None and self._is_async(target):
                method = method.options(concurrency_group=ASYNC_GROUP)
            self._methods[key] = method
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

    def lost(self, rank: int, method: str, exc: BaseException) -> PodiumError:
        """The error for a call whose rank is gone: cut short by shutdown, or the rank died.

        A death makes the group unusable from now on; its error carries the rank's log tail.
        """
        if self.closed:
            return GroupShutdownError(self.name, method=method, ranks=[rank])
        pid = self.pids[rank] if rank < len(self.pids) else None
        path = self.log_paths[rank] if rank < len(self.log_paths) else ""
        err = died_error(rank, exc, pid=pid, log_tail=worker_log_tail(path))
        if self._dead is None:
            self._dead = err
        return err

    def _shutdown(self) -> None:
        self.closed = True
        _live.discard(self)
        state = self._finalizer.detach()
        if state is not None:
            _stop(*state[2])
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


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except OSError:  # exists, owned by someone else
            pass
        alive.append(pid)
    return alive


def _wait_pids(pids: list[int], timeout: float) -> list[int]:
    """Wait until the processes ``pids`` (on this host) are gone; those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _pids_alive(pids)
        if not pids or time.monotonic() >= deadline:
            return pids
        time.sleep(0.02)


_wait_pids_remote = ray.remote(num_cpus=0, max_retries=0)(_wait_pids)


def _wait_exit(procs: list[tuple[str, int]], timeout: float) -> None:
    """Wait (up to ``timeout``) for the rank processes ``(node id, pid)`` to end: on this
    node directly, on others with a small task placed on each of those nodes."""
    here = ray.get_runtime_context().get_node_id()
    by_node: dict[str, list[int]] = {}
    for node, pid in procs:
        by_node.setdefault(node, []).append(pid)
    remote = []
    for node, pids in by_node.items():
        if node != here and node:
            try:
                strategy = NodeAffinitySchedulingStrategy(node, soft=False)
                remote.append(
                    _wait_pids_remote.options(scheduling_strategy=strategy).remote(pids, timeout)
                )
            except Exception:  # the node is gone: so are its processes
                pass
    _wait_pids(by_node.get(here, []), timeout)
    if remote:
        try:
            ray.wait(remote, num_returns=len(remote), timeout=timeout + 5, fetch_local=False)
        except Exception:
            pass


def _stop(
    actors: list[Any],
    procs: list[tuple[str, int]],
    inflight: weakref.WeakSet[RayRankFuture],
    release: Callable[[], None] | None,
    timeout: float,
) -> None:
    """Cancel the calls in flight, stop every actor gracefully, kill what is left, release."""
    if ray.is_initialized():
        for future in list(inflight):
            future.cancel()
        stops = []
        for actor in actors:
            try:
                stops.append(actor.stop.remote())
            except Exception:  # already dead, or Ray is going away
                pass
        deadline = time.monotonic() + timeout
        if stops:
            try:
                # A stop "fails" with the actor's intentional exit: only the wait matters.
                ray.wait(stops, num_returns=len(stops), timeout=timeout, fetch_local=False)
            except Exception:
                pass
        # A stop answers (Ray marks the actor dead) before the process has run its
        # atexit handlers and exited: wait for the processes themselves, so that the
        # next group on these slots does not meet them (GPU memory, ports).
        _wait_exit(procs, max(0.0, deadline - time.monotonic()))
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
    # Only while Ray is up: the user may have shut their Ray down before the group was
    # dropped (verl's tests do), and Ray's placement-group calls would start a new one.
    if release is not None and ray.is_initialized():
        try:
            release()
        except Exception:  # Ray is gone: its placement groups went with it
            pass


# Groups not shut down yet, and the stops of dropped groups still running.
_live: weakref.WeakSet[RayGroup] = weakref.WeakSet()
_stopping: set[threading.Thread] = set()
_stopping_lock = threading.Lock()


def _stop_in_background(
    actors: list[Any],
    procs: list[tuple[str, int]],
    inflight: weakref.WeakSet[RayRankFuture],
    release: Callable[[], None] | None,
    timeout: float,
) -> None:
    """Stop a group that was garbage collected, without blocking (or deadlocking) the collector."""

    def run() -> None:
        try:
            _stop(actors, procs, inflight, release, timeout)
        except Exception as exc:  # never raise on a background thread
            print(f"podium: stopping a dropped Ray worker group failed: {exc!r}", file=sys.stderr)
        finally:
            with _stopping_lock:
                _stopping.discard(thread)

    thread = threading.Thread(target=run, name="podium-ray-stop", daemon=True)
    with _stopping_lock:
        _stopping.add(thread)
    thread.start()


def finish_dropped_stops(timeout: float) -> None:
    """Wait (up to ``timeout``) for the stops of dropped groups, so their slots are free."""
    deadline = time.monotonic() + timeout
    with _stopping_lock:
        threads = list(_stopping)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


@atexit.register
def _stop_all_at_exit() -> None:
    """The controller exits: stop its live groups (and finish dropped ones') before Ray shuts down."""

    def stop(group: RayGroup) -> None:
        try:
            group.shutdown()
        except Exception:  # exiting: stop what can be stopped
            pass

    # All at once: each waits for its ranks' hooks and exits.
    stoppers = [threading.Thread(target=stop, args=(g,), daemon=True) for g in list(_live)]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join(timeout=60)
    with _stopping_lock:
        threads = list(_stopping)
    for thread in threads:
        thread.join(timeout=30)


def worker_log_tail(paths: str, lines: int = 20) -> str:
    """The last lines of a worker's log files (``paths``: its stderr and stdout files,
    separated by ``os.pathsep``), when they are readable from here (else "")."""
    out = []
    for path in [p for p in paths.split(os.pathsep) if p]:
        try:
            with open(path, errors="replace") as f:
                # Ray's own marker lines (":job_id:...", ":actor_name:...") say nothing here.
                text = [ln.rstrip() for ln in f if ln.strip() and not ln.startswith(":")]
            tail = text[-lines:]
        except OSError:  # on another host, or gone
            continue
        if tail:
            out.append(f"[{os.path.basename(path)}]\n" + "\n".join(tail))
    return "\n".join(out)
