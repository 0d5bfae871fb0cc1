"""The worker host: what runs inside every rank, on every backend.

A backend starts a process (or an actor, or an object), builds one
:class:`WorkerHost` in it, and hands it each call it receives. The host builds
the user's worker with the rank already known, resolves the call's target
(``"method"``, or ``"role:method"`` for colocated roles), materializes futures,
runs ``async def`` methods, and turns a user exception into a picklable
:class:`RemoteFailure` so that the backend can ship it like any result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import inspect
import sys
import threading
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from podium.core import dataplane
from podium.core.decorator import get_method_spec
from podium.core.dispatch import PaddedResult, finish_worker_pads, start_worker_pads
from podium.core.futures import DataProtoFuture
from podium.core.worker import (
    ClassWithInitArgs,
    ColocatedWorker,
    RankInfo,
    _constructing_rank,
    colocated_roles,
)
from podium.errors import RemoteError, exception_parts, make_remote_error, rebuild_exception

__all__ = [
    "ARGUMENT_NOT_LOADED",
    "MESH_INFO",
    "RESULT_NOT_LOADED",
    "RESULT_NOT_SENT",
    "RETURNED_NONE",
    "Outcome",
    "RemoteFailure",
    "WorkerHost",
    "clear_dtensor_caches",
    "crossing_failure",
    "has_async_methods",
    "is_async_target",
    "max_async_calls",
    "release_process_groups",
    "split_target",
]

# Built-in target: returns the worker's (dp_rank, is_collect) for a mesh name.
MESH_INFO = "__podium_mesh_info__"


def split_target(target: str) -> tuple[str | None, str]:
    role, sep, name = target.rpartition(":")
    return (role if sep else None), name


@dataclass
class RemoteFailure:
    """A user exception, captured in a worker, in a form that always pickles."""

    rank: int | None
    method: str
    type_name: str
    message: str
    traceback: str
    exception: bytes | None  # cloudpickled original exception, when it pickles

    @classmethod
    def capture(cls, exc: BaseException, rank: int | None, method: str) -> RemoteFailure:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        payload: bytes | None
        try:
            # Rebuilt without calling the class's __init__ (whose signature may
            # not match exc.args), so user exceptions with their own
            # constructors keep their class and fields.
            payload = cloudpickle.dumps(exception_parts(exc))
        except Exception:
            payload = None
        return cls(rank, method, type(exc).__qualname__, str(exc), tb, payload)

    def to_exception(self) -> RemoteError:
        cause: BaseException | None = None
        if self.exception is not None:
            try:
                cause = rebuild_exception(*cloudpickle.loads(self.exception))
            except Exception:
                cause = None
        if cause is None:
            return RemoteError(
                f"{self.type_name}: {self.message}",
                rank=self.rank,
                method=self.method,
                remote_traceback=self.traceback,
            )
        return make_remote_error(cause, rank=self.rank, method=self.method, remote_traceback=self.traceback)


@dataclass
class Outcome:
    """One call's result on one rank: a value, or a failure."""

    ok: bool
    value: Any

    def unwrap(self) -> Any:
        if self.ok:
            return self.value
        failure: RemoteFailure = self.value
        raise failure.to_exception()


# The outcome of most calls, shared (outcomes are never changed).
RETURNED_NONE = Outcome(True, None)

# Where a value failed to cross between the controller and a worker (see crossing_failure).
ARGUMENT_NOT_LOADED = "an argument of the call could not be unpickled in the worker"
RESULT_NOT_SENT = "the return value could not be pickled in the worker"
RESULT_NOT_LOADED = "the return value could not be unpickled at the controller"


def crossing_failure(exc: BaseException, rank: int | None, method: str, where: str) -> Outcome:
    """``exc``, raised while a call's value crossed the process boundary, as the call's failed outcome.

    Every backend reports such a value alike, wherever the pickling failed: the
    caller gets a :class:`podium.RemoteError` that is also ``type(exc)``, with the
    call's rank and method, and a note saying which value failed where
    (``where``: :data:`ARGUMENT_NOT_LOADED`, :data:`RESULT_NOT_SENT` or
    :data:`RESULT_NOT_LOADED`). The group stays usable. An argument that fails to
    pickle at the controller is not one of these: it raises from the call itself.
    """
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc
    failure = RemoteFailure.capture(exc, rank, method)
    failure.traceback += f"podium: {where} (rank {rank}, method {method!r})\n"
    return Outcome(False, failure)


class WorkerHost:
    """Owns the user's worker object in one rank."""

    def __init__(self, info: RankInfo, cls_with_init: ClassWithInitArgs[Any]) -> None:
        self.info = info
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._slots: asyncio.Semaphore | None = None  # created on the loop, at its first call
        self.shards = dataplane.ShardStore()  # outputs of output="ref" calls kept here
        self._pinned = 0  # the thread ident pin() was called from
        self._direct: dict[str, Callable[[], Outcome]] = {}  # see direct()
        token = _constructing_rank.set(info)
        try:
            self.worker = cls_with_init()
        finally:
            _constructing_rank.reset(token)
        # The CUDA device is per thread: the loop's thread takes the one the
        # rank's main thread chose (the backend, or the worker's constructor).
        self._cuda_device = _current_cuda_device()

    @classmethod
    def start(cls, info: RankInfo, cls_with_init: ClassWithInitArgs[Any]) -> tuple[WorkerHost | None, Outcome]:
        """Build a host, capturing a failing user constructor as an :class:`Outcome`."""
        try:
            return cls(info, cls_with_init), Outcome(True, None)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return None, Outcome(False, RemoteFailure.capture(exc, info.rank, "__init__"))

    def _resolve(self, target: str) -> Any:
        role, name = split_target(target)
        if name == dataplane.RELEASE:
            return self.shards.release
        obj = self._owner(role)
        if name == MESH_INFO:
            return obj._query_dispatch_collect_info
        return getattr(obj, name)

    def _owner(self, role: str | None) -> Any:
        """The object a target's method lives on: the worker, or one of its colocated roles."""
        obj = self.worker
        if role is not None:
            if not isinstance(obj, ColocatedWorker) or role not in obj.roles:
                raise AttributeError(f"this worker has no colocated role {role!r}")
            obj = obj.roles[role]
        return obj

    def run(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        """Run one call; never raises for an error in user code."""
        try:
            method = self._resolve(target)
            spec = get_method_spec(method)
            # Shards of a future that dispatch padded here come back with the pad
            # count (a PaddedResult), for the call's collect to remove those rows.
            pads = start_worker_pads()
            store = dataplane.run_in_store(self.shards)
            try:
                if args or kwargs:
                    # A BatchRef argument becomes the rows and keys it names, read from its producers.
                    args = tuple(dataplane.fetch(a) if isinstance(a, dataplane.RowReference) else a for a in args)
                    kwargs = {k: dataplane.fetch(v) if isinstance(v, dataplane.RowReference) else v for k, v in kwargs.items()}
                    if spec is None or spec.materialize_futures:
                        args = tuple(_materialize(a) for a in args)
                        kwargs = {k: _materialize(v) for k, v in kwargs.items()}
                # A Worker built inside a method (a sub-worker, as verl builds in
                # init_model) gets this rank, not the environment's (none inline).
                token = _constructing_rank.set(self.info)
                try:
                    result = method(*args, **kwargs)
                    if result is not None and inspect.isawaitable(result):
                        result = self._run_async(result)
                finally:
                    _constructing_rank.reset(token)
                if spec is not None and spec.output == "ref":
                    result = self._export(method, spec.dispatch_mode, spec.row_meta, target, result)
            finally:
                dataplane.leave_store(store)
                pad = finish_worker_pads(pads)
            return Outcome(True, PaddedResult(result, pad) if pad else result)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return Outcome(False, RemoteFailure.capture(exc, self.info.rank, target))

    def pin(self) -> None:
        """Give the calling thread this rank's context for good (its rank, its shard store).

        For a backend that runs one rank per process and its calls on one thread
        (torchrun's main thread): :meth:`run_bare` on that thread then skips
        setting them for each call.
        """
        _constructing_rank.set(self.info)
        dataplane.run_in_store(self.shards)
        self._pinned = threading.get_ident()

    def run_bare(self, target: str) -> Outcome:
        """``run(target, (), {})``, with less to do per call: on a :meth:`pin`-ned thread.

        A call without arguments has no futures to materialize and no rows to
        pad, and the pinned context already holds the rank and the store, so
        what is left is the method (see :meth:`direct`). An ``output="ref"``
        method, a target that does not resolve, or another thread, takes :meth:`run`.
        """
        # None off the pinned thread; kept per target after the first call.
        call = self.direct(target)
        return self.run(target, (), {}) if call is None else call()

    def direct(self, target: str) -> Callable[[], Outcome] | None:
        """``run_bare(target)`` as a function of no arguments, for the :meth:`pin`-ned thread.

        A backend whose worker loop keeps it per target calls it instead of
        :meth:`run_bare` for each later call without arguments on that thread.
        It looks the method up on each call (an attribute the worker rebinds is
        honoured); what it keeps from the first look is the verdict that
        ``target`` is a plain method (not ``output="ref"``, not a role or
        service that is missing). ``None`` where :meth:`run` must serve the
        target: on another thread, for an ``output="ref"`` method, the
        data-plane and mesh services, and for a name that does not resolve now
        (its call then fails through :meth:`run` with the usual error).
        """
        if self._pinned != threading.get_ident():
            return None
        known = self._direct.get(target)
        if known is not None:
            return known
        role, name = split_target(target)
        if name == dataplane.RELEASE or name == MESH_INFO:
            return None
        try:
            owner = self._owner(role)
            method = getattr(owner, name)
        except Exception:
            return None
        spec = get_method_spec(method)
        if spec is not None and spec.output == "ref":
            return None
        rank = self.info.rank

        def call() -> Outcome:
            try:
                result = getattr(owner, name)()
                if result is None:
                    return RETURNED_NONE
                if inspect.isawaitable(result):
                    result = self._run_async(result)
                return Outcome(True, result) if result is not None else RETURNED_NONE
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                return Outcome(False, RemoteFailure.capture(exc, rank, target))

        self._direct[target] = call
        return call

    def _export(self, method: Any, mode: Any, row_meta: tuple[str, ...], target: str, result: Any) -> Any:
        """Keep an ``output="ref"`` result here; ranks that do not collect (nd-mesh) keep nothing."""
        mesh = getattr(mode, "mesh_name", None)
        owner = getattr(method, "__self__", None)
        if mesh is not None and owner is not None:
            place = owner._query_dispatch_collect_info(mesh)
            if place is not None and not place[1]:
                return None
        return self.shards.export(result, row_meta, target)

    def _run_async(self, awaitable: Any) -> Any:
        """Run ``awaitable`` on the rank's event loop and wait for it in this thread.

        The loop runs in a thread of its own from the first async call until
        the host closes, so a task one call starts keeps running between calls,
        and objects bound to the loop (clients, queues) serve every later call.
        At most ``max_async_calls`` calls of the worker run on it at once (a
        backend that overlaps async calls runs each in its own thread).
        """
        loop = self._event_loop()
        ctx = contextvars.copy_context()  # the call's rank, store and pads, in the loop's task
        ready: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def start() -> None:
            # A task copies the context it is created in: the caller's, through ctx.
            task = ctx.run(loop.create_task, self._bounded(awaitable))
            _chain(task, ready)

        loop.call_soon_threadsafe(start)
        return ready.result()

    async def _bounded(self, awaitable: Any) -> Any:
        if self._slots is None:
            self._slots = asyncio.Semaphore(max_async_calls(type(self.worker)))
        async with self._slots:
            return await awaitable

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=_run_loop,
                    args=(loop, self._cuda_device),
                    name=f"podium-rank{self.info.rank}-loop",
                    daemon=True,
                )
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def _stop_loop(self) -> None:
        """Cancel the tasks still on the loop (bounded wait), stop it and close it."""
        with self._loop_lock:
            loop, thread = self._loop, self._loop_thread
            self._loop = self._loop_thread = None
        if loop is None or thread is None:
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=LOOP_STOP_S)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(LOOP_STOP_S + 1)
        except Exception:  # a task that ignores cancellation: stop the loop anyway
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(LOOP_STOP_S)
        if not thread.is_alive():
            loop.close()

    def close(self) -> RemoteFailure | None:
        """Run the worker's ``shutdown()`` hook (once), then close the event loop.

        Returns the hook's failure, if any, for the backend to log; never raises
        for an error in user code.
        """
        failure: RemoteFailure | None = None
        worker, self.worker = self.worker, None
        hook = getattr(worker, "shutdown", None) if worker is not None else None
        if callable(hook):
            try:
                result = hook()
                if inspect.isawaitable(result):
                    self._run_async(result)
            except Exception as exc:
                failure = RemoteFailure.capture(exc, self.info.rank, "shutdown")
        self._stop_loop()
        self.shards.close()
        return failure


def release_process_groups() -> str | None:
    """Free what is left of ``torch.distributed`` in a rank process that is about to exit.

    Process backends call it after the worker's ``shutdown()`` hook (the inline
    backend does not: its ranks share the controller's process). A process group
    that lives on to interpreter exit -- never destroyed, or destroyed while FSDP's
    device meshes in DTensor's caches still hold it -- takes its gloo threads into
    Python's teardown, where one that touches a tensor aborts the process
    ("terminate called without an active exception"). So the caches are emptied
    and the default group, if the user left it, is destroyed now. Returns what
    went wrong, for the backend to log; never raises.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        clear_dtensor_caches()
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches, which keep the device mesh of every DTensor op and
    redistribution run so far, and through the meshes their process groups.

    The caches are private to torch and change between releases, so every function cache
    of the ``torch.distributed.tensor`` modules (and of their classes) is cleared, and the
    sharding propagator's own cache, the redistribution planners and the native sharding
    cache by their own calls. The caches
    refill on the next use; clearing them only costs that.
    """
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed.tensor"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, types.ModuleType):  # torch.ops namespaces look up any name
                continue
            members = vars(value).values() if isinstance(value, type) else (value,)
            for member in members:
                member = getattr(member, "__func__", member)  # a cached staticmethod
                clear = getattr(member, "cache_clear", None)
                if callable(clear):
                    clear()
    api = sys.modules.get("torch.distributed.tensor._api")
    dtensor = getattr(api, "DTensor", None)
    propagator = getattr(getattr(dtensor, "_op_dispatcher", None), "sharding_propagator", None)
    clear = getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None)
    if clear is not None:  # a per-instance (and per-thread) cache the scan above cannot see
        clear()
    planners = sys.modules.get("torch.distributed.tensor._redistribute")
    clear_planners = getattr(planners, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()
    torch = sys.modules.get("torch")
    clear_native = getattr(getattr(torch, "_C", None), "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()


def _chain(task: asyncio.Future[Any], ready: concurrent.futures.Future[Any]) -> None:
    """Complete ``ready`` (waited on in another thread) with ``task``'s outcome."""

    def done(t: asyncio.Future[Any]) -> None:
        if t.cancelled():
            ready.set_exception(asyncio.CancelledError("the call was cancelled: its rank is shutting down"))
        elif t.exception() is not None:
            ready.set_exception(t.exception())
        else:
            ready.set_result(t.result())

    task.add_done_callback(done)


def _current_cuda_device() -> int | None:
    """This thread's CUDA device, when this process has set CUDA up (never initializes it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def _run_loop(loop: asyncio.AbstractEventLoop, cuda_device: int | None) -> None:
    if cuda_device is not None:
        sys.modules["torch"].cuda.set_device(cuda_device)
    asyncio.set_event_loop(loop)
    loop.run_forever()


DEFAULT_MAX_ASYNC_CALLS = 16
LOOP_STOP_S = 5.0  # how long close() waits for the loop's tasks to end once cancelled


def max_async_calls(cls: type) -> int:
    """How many ``async def`` calls a rank of ``cls`` runs at once (``Worker.max_async_calls``)."""
    value = getattr(cls, "max_async_calls", DEFAULT_MAX_ASYNC_CALLS)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{cls.__qualname__}.max_async_calls must be an int >= 1, got {value!r}")
    return value


def is_async_target(cls_with_init: ClassWithInitArgs[Any], target: str) -> bool:
    """Whether ``target`` of a group built by ``cls_with_init`` is an ``async def`` method.

    Backends that overlap async calls (``Capabilities.concurrent_async_calls``)
    ask this at the controller to route the call; the answer comes from the
    class, so it is known before any rank runs.
    """
    role, name = split_target(target)
    cls: type = cls_with_init.cls
    if role is not None:
        roles = colocated_roles(cls_with_init)
        if roles is None or role not in roles:
            return False
        cls = roles[role].cls
    return inspect.iscoroutinefunction(getattr(cls, name, None))


def has_async_methods(cls_with_init: ClassWithInitArgs[Any]) -> bool:
    """Whether the worker (or any colocated role) a constructor builds has an ``async def`` method."""
    roles = colocated_roles(cls_with_init)
    classes = [cls_with_init.cls] + [role.cls for role in (roles or {}).values()]
    for cls in classes:
        for name in dir(cls):
            if name.startswith("__"):
                continue
            try:
                value = getattr(cls, name, None)
            except Exception:  # a class-level descriptor that refuses to be read
                continue
            if inspect.iscoroutinefunction(value):
                return True
    return False


def _materialize(value: Any) -> Any:
    if isinstance(value, DataProtoFuture):
        return value.get()
    return value
