"""``WorkerGroup``: a group of ranks driven as one object.

A call on a registered method goes: dispatch (split the arguments per rank)
-> execute (the backend runs each rank's share) -> wait -> collect (gather the
outputs into one result). Everything here is the same for every backend.
"""

from __future__ import annotations

import difflib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from podium.core.backend import (
    BACKEND_NAME_ENV,
    PREFIX_ENV,
    Backend,
    BackendGroup,
    GroupSpec,
    RankCall,
    joining_rows,
    resolve_backend,
)
from podium.core.batching import unpad
from podium.core.batchref import BatchRef, adopt, flush_releases, keep_inputs
from podium.core.decorator import (
    Dispatch,
    DispatchMode,
    Execute,
    MethodSpec,
    get_method_spec,
    resolve_dispatch_mode,
)
from podium.core.dispatch import (
    BoundCollect,
    PortableCollect,
    collect_all_to_all,
    collect_dp_compute_data_proto,
    dispatch_all_to_all,
    dispatch_one_to_all,
    strip_pads,
)
from podium.core.futures import DataProtoFuture, RankFuture, get
from podium.core.host import MESH_INFO
from podium.core.modes import MeshLayout, pad_of
from podium.core.resource import ResourcePool
from podium.core.worker import ClassWithInitArgs, colocated_roles

__all__ = ["WorkerGroup"]


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every ``@register``-ed method of ``cls`` (inherited ones included)."""
    found: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            spec = get_method_spec(value)
            if spec is not None:
                found[name] = spec
            elif name in found:
                del found[name]  # overridden without @register
    return found


def _per_rank_calls(args: tuple[Any, ...], kwargs: dict[str, Any], world_size: int) -> list[RankCall]:
    """The per-rank slicing rule: lists of length world_size are split, else sent whole."""
    values = list(args) + list(kwargs.values())
    if all(isinstance(v, list) and len(v) == world_size for v in values):
        return [
            RankCall(i, tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()})
            for i in range(world_size)
        ]
    return [RankCall(i, args, kwargs) for i in range(world_size)]


class WorkerGroup:
    """Ranks of one worker class on a pool, driven as one object.

    ``WorkerGroup(pool, ClassWithInitArgs(MyWorker, ...), backend="ray")``
    starts ``pool.world_size`` ranks. Every ``@register``-ed method of
    ``MyWorker`` is then a method of the group.

    ``backend=None`` reads ``$PODIUM_BACKEND`` and falls back to ``"ray"``;
    that backend's options start from ``$PODIUM_BACKEND_OPTIONS`` (JSON).
    ``call_timeout`` is the default deadline (seconds) of every call.
    """

    def __init__(
        self,
        resource_pool: ResourcePool,
        cls_with_init: ClassWithInitArgs[Any] | None = None,
        *,
        backend: Backend | str | None = None,
        name_prefix: str | None = None,
        worker_env: Mapping[str, str] | None = None,
        backend_options: Mapping[str, Any] | None = None,
        call_timeout: float | None = None,
        ray_cls_with_init: ClassWithInitArgs[Any] | None = None,
    ) -> None:
        if ray_cls_with_init is not None:
            if cls_with_init is not None:
                raise TypeError("pass cls_with_init or ray_cls_with_init (its old name), not both")
            warnings.warn(
                "WorkerGroup(ray_cls_with_init=...) is the verl spelling; pass cls_with_init= "
                "(or the constructor as the second positional argument)",
                DeprecationWarning,
                stacklevel=2,
            )
            cls_with_init = ray_cls_with_init
        if cls_with_init is None:
            raise TypeError("WorkerGroup needs cls_with_init: ClassWithInitArgs(MyWorker, ...)")
        if not isinstance(resource_pool, ResourcePool):
            raise TypeError(f"resource_pool must be a ResourcePool, got {type(resource_pool).__name__}")
        if not isinstance(cls_with_init, ClassWithInitArgs):
            raise TypeError(
                f"cls_with_init must be a ClassWithInitArgs, got {cls_with_init!r}; "
                "wrap the class: ClassWithInitArgs(MyWorker, *args, **kwargs)"
            )
        _check_timeout(call_timeout)
        self._backend = resolve_backend(backend, backend_options)
        name_prefix = name_prefix or _default_name(cls_with_init)
        env = dict(worker_env or {})
        if self._backend.capabilities.worker_env:
            # The names verl's utilities read in a worker; the user's own values win.
            env.setdefault(PREFIX_ENV, name_prefix)
            env.setdefault(BACKEND_NAME_ENV, self._backend.name)
        spec = GroupSpec(
            pool=resource_pool,
            cls_with_init=cls_with_init,
            name_prefix=name_prefix,
            worker_env=env,
        )
        group = self._backend.start_group(spec)
        # A group dropped without shutdown() (its last reference gone, or the
        # interpreter exiting) releases what it holds, as shutdown() does.
        weakref.finalize(self, group.shutdown)
        self._setup(group, cls_with_init, role=None, call_timeout=call_timeout, owner=None)
        self.resource_pool: ResourcePool | None = resource_pool
        self.name_prefix = spec.name_prefix

    def _setup(
        self,
        group: BackendGroup,
        cls_with_init: ClassWithInitArgs[Any],
        *,
        role: str | None,
        call_timeout: float | None,
        owner: WorkerGroup | None,
    ) -> None:
        self._group = group
        self._cls_with_init = cls_with_init
        self._role = role
        self._call_timeout = call_timeout
        self._owner = owner
        self._owns_workers = owner is None
        self._methods = registered_methods(cls_with_init.cls)
        self._mesh_layouts: dict[str, MeshLayout] = {}
        self._argless: dict[str, tuple[DispatchMode, list[RankCall]]] = {}  # see _argless_calls

    @classmethod
    def attach(
        cls,
        name_prefix: str,
        worker: ClassWithInitArgs[Any] | type,
        *,
        backend: Backend | str | None = None,
        backend_options: Mapping[str, Any] | None = None,
        call_timeout: float | None = None,
    ) -> WorkerGroup:
        """A group over named workers another controller started (``capabilities.named_workers``).

        ``worker`` is their class (or constructor), used for the method table.
        Shutting the attached group down detaches; the workers keep running.
        """
        the_backend = resolve_backend(backend, backend_options)
        cwa = worker if isinstance(worker, ClassWithInitArgs) else ClassWithInitArgs(worker)
        wg = cls.__new__(cls)
        wg._backend = the_backend
        wg._setup(the_backend.attach_group(name_prefix), cwa, role=None, call_timeout=call_timeout, owner=None)
        wg._owns_workers = False
        wg.name_prefix = name_prefix
        return wg

    # -- properties ----------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def worker_names(self) -> list[str]:
        return list(self._group.worker_names)

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def capabilities(self) -> Any:
        return self._backend.capabilities

    @property
    def backend_handles(self) -> Any:
        """The backend's native objects behind this group's ranks, in rank order (an escape hatch).

        For code that needs the backend itself -- starting server actors next to
        the workers, reading their placement. A typed record per backend:
        :class:`podium.backends.ray.RayHandles` (actor handles, placement groups,
        bundle indices), :class:`podium.backends.torchrun.TorchrunHandles`
        (process ids, hosts), :class:`podium.backends.inline.InlineHandles`
        (the worker objects). Using them ties the code to that backend; podium's
        own calls never need them. A view from ``spawn``/``fuse`` returns its
        group's handles.
        """
        return self._live_group().handles()

    # -- registered methods --------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails; guard attributes read before _setup.
        if name.startswith("__") or name in ("_methods", "_cls_with_init", "_group"):
            raise AttributeError(name)
        methods = self.__dict__.get("_methods")
        if methods is None:
            raise AttributeError(name)
        spec = methods.get(name)
        if spec is None:
            raise AttributeError(self._missing_method_message(name))
        method = getattr(self._cls_with_init.cls, name)
        # Later lookups skip __getattr__ (a hot path) and find a caller that does
        # not keep the group alive; the one returned now does, so a group used
        # only in one expression (WorkerGroup(...).method()) lives through the call.
        self.__dict__[name] = functools.update_wrapper(_RegisteredCall(self, name, spec), method)
        return functools.update_wrapper(_RegisteredCall(self, name, spec, hold=True), method)

    def __dir__(self) -> Iterable[str]:
        return sorted(set(super().__dir__()) | set(self.__dict__.get("_methods", {})))

    def _missing_method_message(self, name: str) -> str:
        cls = self._cls_with_init.cls
        where = f"{cls.__qualname__}" + (f" (role {self._role!r})" if self._role else "")
        if callable(getattr(cls, name, None)):
            return (
                f"{where}.{name} is not callable through a WorkerGroup: decorate it with "
                f"@register(dispatch_mode=...) (from podium import register), or call it on every "
                f"rank with wg.execute_all_sync({name!r}, ...)"
            )
        close = difflib.get_close_matches(name, list(self._methods), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"{where} has no registered method {name!r}.{hint} Registered: {sorted(self._methods)}"

    def _live_group(self) -> BackendGroup:
        if self.__dict__.get("_detached") or getattr(self._group, "_podium_closed", False):
            raise RuntimeError(
                f"this WorkerGroup ({self.name_prefix}) was shut down; start a new WorkerGroup to call its workers"
            )
        return self._group

    def _target(self, name: str) -> str:
        return f"{self._role}:{name}" if self._role else name

    def _call_registered(self, name: str, spec: MethodSpec, *args: Any, **kwargs: Any) -> Any:
        mode = resolve_dispatch_mode(spec.dispatch_mode)
        flush_releases()  # shards whose last BatchRef is gone are freed with the next call
        if args or kwargs:
            args, kwargs = self._resolve_futures(args, kwargs)
        else:
            kept = self._argless.get(name)
            if kept is None or kept[0] is not mode:  # update_dispatch_mode may replace a mode
                kept = self._argless[name] = (mode, self._argless_calls(spec, mode))
            calls = kept[1]
            if calls:  # what the steps below come to for this call: submit, wait, the list
                timeout = spec.timeout if spec.timeout is not None else self._call_timeout
                return _gather(self._live_group().submit(self._target(name), calls, timeout=timeout), timeout)
        dispatched = mode.dispatch_fn(self, *args, **kwargs)
        d_args, d_kwargs = dispatched
        pad = pad_of(dispatched)
        timeout = spec.timeout if spec.timeout is not None else self._call_timeout
        target = self._target(name)

        if spec.execute_mode is Execute.RANK_ZERO or spec.dispatch_mode is Dispatch.RANK_ZERO:
            if spec.dispatch_mode is Dispatch.RANK_ZERO:
                call = RankCall(0, tuple(d_args), dict(d_kwargs))  # the arguments as given
            else:
                call = _per_rank_calls(tuple(d_args), dict(d_kwargs), self.world_size)[0]
            (future,) = self._live_group().submit(target, [call], timeout=timeout)
            if not spec.blocking:
                keep_inputs([future], args, kwargs)
                return future
            value = strip_pads([get(future, timeout)])[0][0]
            return adopt([value], self._group, self.name_prefix, spec.row_meta, name)[0] if spec.output == "ref" else value

        futures = self._live_group().submit(
            target, _per_rank_calls(tuple(d_args), dict(d_kwargs), self.world_size), timeout=timeout
        )
        if not spec.blocking:
            keep_inputs(futures, args, kwargs)
            if mode.dp:
                return DataProtoFuture(self._future_collect(mode, pad), futures)
            return futures
        # Rows padded in the workers (a future's shards) come back with the outputs.
        if spec.output != "ref" and self._joins_rows(mode, len(futures)):
            with joining_rows():  # see rows_joined
                outputs, worker_pad = strip_pads(_gather(futures, timeout))
        else:
            outputs, worker_pad = strip_pads(_gather(futures, timeout))
        if spec.output == "ref":  # each rank kept its output: one-shard BatchRefs, collected as data
            outputs = adopt(outputs, self._group, self.name_prefix, spec.row_meta, name)
        return unpad(mode.collect_fn(self, outputs), pad or worker_pad)

    def _argless_calls(self, spec: MethodSpec, mode: DispatchMode) -> list[RankCall]:
        """Every rank's share of a blocking call without arguments whose result is the ranks' outputs.

        Empty when the method's call is anything else (a mode of its own, one
        rank, futures or BatchRefs out): that takes the general path. Kept per
        method and mode, so a no-op call (a barrier, a step) skips the dispatch and
        collect it does not need. Without arguments no rank pads rows, so the
        outputs come back as they are.
        """
        plain = (
            spec.blocking
            and spec.output != "ref"
            and spec.execute_mode is Execute.ALL
            and spec.dispatch_mode is not Dispatch.RANK_ZERO
            and mode.mesh_name is None
            and mode.dispatch_fn in (dispatch_one_to_all, dispatch_all_to_all)
            and mode.collect_fn is collect_all_to_all
        )
        return [RankCall(rank, (), {}) for rank in range(self.world_size)] if plain else []

    def _joins_rows(self, mode: DispatchMode, ranks: int) -> bool:
        """Whether ``mode``'s collect concatenates the outputs of two or more ranks into new rows."""
        if mode.mesh_name is not None:
            return len(self.mesh_layout(mode.mesh_name).collect_ranks) >= 2
        return mode.collect_fn is collect_dp_compute_data_proto and ranks >= 2

    def _future_collect(self, mode: DispatchMode, pad: int) -> Callable[[list[Any]], Any]:
        if mode.mesh_name is not None:
            return PortableCollect(self.mesh_layout(mode.mesh_name).collect_ranks, pad)
        if mode.collect_fn is collect_dp_compute_data_proto:
            return PortableCollect(None, pad)
        return BoundCollect(mode.collect_fn, self, pad)

    def _resolve_futures(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rank futures are resolved here; DataProtoFutures too unless they can move worker to worker."""
        w2w = self._backend.capabilities.worker_to_worker_futures
        refs = getattr(self._backend.capabilities, "batch_refs", False)

        def resolve(value: Any) -> Any:
            if isinstance(value, BatchRef):
                # A backend without batch_refs (or rows the controller holds): the rows go by value.
                if not refs or value.held_by_controller:
                    return value.materialize()
                value._check_live()
                return value
            if isinstance(value, DataProtoFuture):
                if w2w and isinstance(value.collect_fn, PortableCollect):
                    return value
                return value.get()
            if isinstance(value, RankFuture):
                return get(value)
            if isinstance(value, list) and value and all(isinstance(v, RankFuture) for v in value):
                return get(value)
            return value

        return tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}

    def mesh_layout(self, mesh_name: str) -> MeshLayout:
        """Each rank's place in the mesh ``mesh_name`` (asked of the workers once, then kept)."""
        layout = self._mesh_layouts.get(mesh_name)
        if layout is None:
            infos = self.execute_all_sync(MESH_INFO, mesh_name)
            layout = MeshLayout.from_infos(mesh_name, infos)
            self._mesh_layouts[mesh_name] = layout
        return layout

    _mesh_layout = mesh_layout  # the earlier, private name

    # -- raw execution -------------------------------------------------------

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[RankFuture]:
        """Run ``method_name`` on every rank (per-rank slicing rule); return the futures."""
        return self._live_group().submit(
            self._target(method_name),
            _per_rank_calls(args, kwargs, self.world_size),
            timeout=self._call_timeout,
        )

    execute_all = execute_all_async

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return get(self.execute_all_async(method_name, *args, **kwargs), self._call_timeout)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> RankFuture:
        (future,) = self._live_group().submit(
            self._target(method_name), [RankCall(0, args, kwargs)], timeout=self._call_timeout
        )
        return future

    execute_rank_zero = execute_rank_zero_async

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return get(self.execute_rank_zero_async(method_name, *args, **kwargs), self._call_timeout)

    # -- colocation ----------------------------------------------------------

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
        """One view per colocated role, over the same processes."""
        roles = colocated_roles(self._cls_with_init)
        if roles is None:
            raise TypeError(
                "spawn() needs a group started from create_colocated_worker_cls({...}); "
                f"this group runs {self._cls_with_init.cls.__qualname__}"
            )
        views = {}
        for role in prefix_set:
            if role not in roles:
                raise KeyError(f"no colocated role {role!r}; roles: {sorted(roles)}")
            view = WorkerGroup.__new__(WorkerGroup)
            view._backend = self._backend
            view._setup(self._group, roles[role], role=role, call_timeout=self._call_timeout, owner=self)
            view.resource_pool = getattr(self, "resource_pool", None)
            view.name_prefix = f"{self.name_prefix}:{role}"
            views[role] = view
        return views

    def fuse(self, prefixes: Iterable[str]) -> dict[str, WorkerGroup]:
        """Make each colocated role a view attribute of this group: ``wg.actor.update(...)``.

        The views are :meth:`spawn`'s (same processes, same machinery); the
        fused group keeps its own registered methods. A role whose name is
        already an attribute or a registered method of the group is refused.
        """
        names = list(prefixes)
        taken = [n for n in names if n in self._methods or hasattr(type(self), n)]
        if taken:
            raise ValueError(
                f"cannot fuse roles {taken}: the group already has attributes of those names; "
                "use wg.spawn(...) and keep the views in your own variables"
            )
        views = self.spawn(names)
        self.__dict__.update(views)
        return views

    # -- lifecycle -----------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the group's workers (idempotent). Views from spawn() share them: stopping one stops all."""
        if self._owner is not None:
            self._owner.shutdown()
            return
        if self._owns_workers:
            self._group.shutdown()
        else:
            self._detached = True  # attached: the workers belong to another controller

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        cls = self._cls_with_init.cls.__qualname__
        role = f" role={self._role!r}" if self._role else ""
        return f"<WorkerGroup {cls}{role} world_size={self.world_size} backend={self.backend!r}>"


class _RegisteredCall:
    """``wg.<method>``, cached on the group: it reaches the group through a weak
    reference, so the cache makes no reference cycle and a dropped group is freed
    (and its workers released) at once, not at the next garbage collection."""

    def __init__(self, wg: WorkerGroup, name: str, spec: MethodSpec, *, hold: bool = False) -> None:
        self._wg = weakref.ref(wg)
        self._held = wg if hold else None
        self._name = name
        self._spec = spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        wg = self._wg()
        if wg is None:
            raise RuntimeError(
                f"the WorkerGroup of {self._name!r} was dropped (garbage collected); keep a "
                "reference to the group while you call its methods"
            )
        return wg._call_registered(self._name, self._spec, *args, **kwargs)


def _gather(futures: list[RankFuture], timeout: float | None) -> list[Any]:
    """``get(futures, timeout)`` for one submission's futures (all of one backend's class)."""
    if futures and len(set(map(type, futures))) == 1:
        return list(type(futures[0]).gather(futures, timeout))
    return get(futures, timeout)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"call_timeout must be a positive number of seconds or None, got {timeout!r}")


def _default_name(cwa: ClassWithInitArgs[Any]) -> str:
    import uuid

    base = "colocated" if colocated_roles(cwa) is not None else cwa.cls.__name__
    return f"{base}_{uuid.uuid4().hex[:8]}"
