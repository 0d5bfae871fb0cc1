"""Everything a backend plugin imports, and the contract it implements.

A backend is a :class:`Backend` subclass named by an entry point in the group
``podium.backends``. It starts one process (or actor, or object) per slot of a
pool, builds a :class:`WorkerHost` in each, and hands every call it receives to
``host.run``. :class:`podium.WorkerGroup` does the rest -- dispatch, collect,
padding, futures, colocated views -- the same way for every backend. Modules
under ``podium.core`` are internal; import from here. ``podium conformance
NAME`` runs the conformance suite that checks the rules below;
``docs/writing-a-backend.md`` walks through a complete backend.

The contract
============

Starting
--------
1. ``Backend._start_group(spec)`` starts ``spec.pool.world_size`` ranks and
   returns when every rank's user constructor ran. A constructor that raises
   is raised at the controller (``Outcome.unwrap()`` of the host's start
   outcome does it); a process that cannot start raises
   :class:`WorkerStartupError`. Nothing is left running on failure.
2. ``WorkerStartupError.log_tail`` holds the last lines (about 50) of the
   failing rank's output when the backend captured it, else ``""``.
3. Each rank's :class:`RankInfo` comes from :func:`rank_infos`: ranks in pool
   order; ``node_rank`` is the index of the rank's entry in ``pool.store``
   (relative to the group, as torchrun's ``GROUP_RANK``; a merged pool's parts
   are different nodes), ``local_rank``/``local_world_size`` are its place in
   that entry. A backend that learns the real layout only after placement
   (Ray's PACK/SPREAD) may replace these three with what it finds.
4. Environment. ``spec.worker_env`` is in the environment the worker's
   interpreter starts with, so variables read at import time
   (``OMP_NUM_THREADS``, ``CUDA_*``, ``NCCL_*``) take effect; a backend that
   cannot do this does not declare ``Capabilities.worker_env`` (and then must
   not ignore ``worker_env`` silently: the inline backend refuses values that
   conflict with the controller's). The rank variables (:data:`RESERVED_ENV`)
   are in ``os.environ`` before the user's constructor runs, on backends with
   ``process_group``; they may be set after the interpreter starts, since
   ``MASTER_PORT`` exists only once rank 0 does.
5. Worker classes travel with :func:`dumps`/:func:`loads` (cloudpickle,
   protocol 5, tensors out of band), never stdlib ``pickle``: a class from the
   user's script or a test file is not importable in the worker and must go
   by value. ``Backend.start_group`` has already marked such modules for
   by-value pickling before ``_start_group`` runs.
6. ``worker_names`` has ``world_size`` unique strings in rank order, by
   convention ``f"{spec.name_prefix}_{rank}"``; on backends with
   ``named_workers`` they are the names ``attach_group`` finds.

Calling
-------
7. ``BackendGroup.submit(target, calls, timeout=)`` returns one
   :class:`RankFuture` per :class:`RankCall`, in order, and never waits for a
   rank: it returns while earlier calls still run (it may run a call at once
   when the rank is idle, as the inline backend does; callers never rely on
   either). ``target`` is passed to ``WorkerHost.run`` unchanged.
8. Targets. ``"method"`` or ``"role:method"`` (colocated roles); the host
   resolves any attribute of the worker, ``@register``-ed or not
   (``wg.execute_all_sync("any_method")`` works), and the reserved target
   :data:`MESH_INFO` answers mesh queries. An unknown target is a per-call
   ``AttributeError`` (as a ``RemoteError``), never a dead rank.
9. Each rank runs its calls one at a time, in submission order.
10. Payloads: a rank's arguments and results cross with :func:`dumps` and
    :func:`loads`. A value that fails to pickle or unpickle on either side is
    that call's failure, built with :func:`crossing_failure` (the caller gets a
    ``RemoteError`` of the original type saying where it failed); the group
    lives on. An argument that fails to pickle at the controller raises from
    ``submit`` itself, before any rank runs.
11. ``timeout`` is the call's deadline in seconds from ``submit`` (``None``:
    none). With ``Capabilities.call_timeout`` a future's ``result`` raises
    :class:`CallTimeoutError` (naming the method and the ranks that did not
    answer) once it passes; the group stays usable and the late result is
    dropped. With ``cancels_timed_out_calls`` the call is also stopped on its
    ranks so the next call does not wait behind it; without it the call runs to
    its end. A backend without ``call_timeout`` may ignore ``timeout``.
12. A rank that dies (killed, ``os._exit``, ``sys.exit``) fails every pending
    future of the whole group -- not only its own -- with
    :class:`WorkerDiedError` within seconds, and every later ``submit`` fails
    the same way at once. Never a hang.
13. ``worker_to_worker_futures``: a :class:`RankFuture` of this backend
    pickles, and its ``result()`` works inside another group's worker, so a
    ``DataProtoFuture`` passed into a call resolves there (its collect needs no
    controller state). Declare it only then.

Resources
---------
14. ``check_resources(pools)`` answers within seconds, starts and reserves
    nothing, and raises :class:`ResourceUnavailableError` (with demand and
    supply) for pools the cluster can never hold -- including ``use_gpu=True``
    pools on a backend without ``gpu``. ``start_group`` calls it first.
15. A backend that places ranks on slots lets at most
    ``pool.max_colocate_count`` groups share a slot; one more raises
    :class:`ResourceUnavailableError` naming ``max_colocate_count`` before
    anything starts. State it owns per pool is kept by the backend, keyed by
    the pool (weakly): a :class:`ResourcePool` is a pure spec.

Lifetime and threads
--------------------
16. ``BackendGroup.shutdown()`` is idempotent (the base class guarantees it),
    runs each rank's ``Worker.shutdown()`` hook through ``WorkerHost.close``,
    waits a bounded time, then kills: afterwards no process, actor or port
    of the group is left. Calls in flight raise :class:`GroupShutdownError`.
    A rank that is a process of its own calls :func:`release_process_groups`
    after ``WorkerHost.close`` and before it exits, so that a process group
    the user left does not abort the process in Python's teardown.
17. A group dropped without ``shutdown()`` is shut down by a finalizer of its
    :class:`podium.WorkerGroup` (at garbage collection or interpreter exit),
    from any thread: ``shutdown`` must not need the controller's main thread.
18. One backend instance is shared by every group with the same name and
    options in a process (``load_backend``); ``start_group``, ``submit`` and
    ``shutdown`` are called from several threads at once and must be safe.

Async calls and native handles
------------------------------
19. ``async def`` targets: ``WorkerHost.run`` waits for the coroutine, which
    runs on the rank's event loop (kept running between calls by the host),
    so rule 9 needs nothing more. A backend that declares
    ``Capabilities.concurrent_async_calls`` runs each target for which
    :func:`is_async_target` is true in a thread of its own (at most
    :func:`max_async_calls` of the worker class at once), so the rank starts
    its next calls while it awaits; other calls keep rule 9.
20. ``BackendGroup.handles()`` (optional) returns a typed record of the
    backend's native objects per rank (``WorkerGroup.backend_handles``); the
    default raises ``NotImplementedError``.
"""

from __future__ import annotations

from podium.core.backend import (
    RESERVED_ENV,
    Backend,
    BackendGroup,
    BackendOption,
    Capabilities,
    GroupSpec,
    RankCall,
)
from podium.core.futures import RankFuture
from podium.core.host import (
    ARGUMENT_NOT_LOADED,
    MESH_INFO,
    RESULT_NOT_LOADED,
    RESULT_NOT_SENT,
    Outcome,
    RemoteFailure,
    WorkerHost,
    crossing_failure,
    is_async_target,
    max_async_calls,
    release_process_groups,
)
from podium.core.resource import ResourcePool
from podium.core.serialization import dumps, loads
from podium.core.worker import ClassWithInitArgs, RankInfo
from podium.errors import (
    CallTimeoutError,
    GroupShutdownError,
    RemoteError,
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerStartupError,
)

__all__ = [
    "ARGUMENT_NOT_LOADED",
    "MESH_INFO",
    "RESERVED_ENV",
    "RESULT_NOT_LOADED",
    "RESULT_NOT_SENT",
    "Backend",
    "BackendGroup",
    "BackendOption",
    "CallTimeoutError",
    "Capabilities",
    "ClassWithInitArgs",
    "GroupShutdownError",
    "GroupSpec",
    "Outcome",
    "RankCall",
    "RankFuture",
    "RankInfo",
    "RemoteError",
    "RemoteFailure",
    "ResourcePool",
    "ResourceUnavailableError",
    "WorkerDiedError",
    "WorkerHost",
    "WorkerStartupError",
    "crossing_failure",
    "dumps",
    "is_async_target",
    "loads",
    "max_async_calls",
    "rank_infos",
    "release_process_groups",
]


def rank_infos(
    pool: ResourcePool, *, master_addr: str | None = None, master_port: int | None = None
) -> list[RankInfo]:
    """Each rank's :class:`RankInfo` for a group on ``pool``, the same on every backend (rule 3)."""
    infos = []
    rank = 0
    for node, count in enumerate(pool.store):
        for local in range(count):
            infos.append(
                RankInfo(
                    rank=rank,
                    world_size=pool.world_size,
                    local_rank=local,
                    local_world_size=count,
                    node_rank=node,
                    master_addr=master_addr,
                    master_port=master_port,
                )
            )
            rank += 1
    return infos
