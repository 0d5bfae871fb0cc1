"""The worker side: the user's ``Worker`` base class and deferred constructors."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from podium.core.decorator import Dispatch, Execute, register

__all__ = [
    "ClassWithInitArgs",
    "ColocatedWorker",
    "Colocation",
    "RankInfo",
    "Worker",
    "colocated_roles",
    "create_colocated_worker_cls",
    "create_colocated_worker_raw_cls",
]

T = TypeVar("T")


@dataclass(frozen=True)
class RankInfo:
    """Where one worker sits in its group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @classmethod
    def from_env(cls) -> RankInfo:
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
        )


# Set by the worker host around the user's constructor and every call, so that
# Worker.__init__ (and a Worker built inside a method) knows its rank.
_constructing_rank: contextvars.ContextVar[RankInfo | None] = contextvars.ContextVar(
    "podium_constructing_rank", default=None
)


class Worker:
    """Base class for user workers. A plain class: no backend decorator.

    ``rank``, ``world_size``, ``local_rank`` and ``local_world_size`` are valid
    from ``__init__`` on. On backends with processes the environment also has
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
    and ``MASTER_PORT``, so ``torch.distributed.init_process_group()`` works as is.
    """

    _podium_rank_info: RankInfo
    _podium_mesh: dict[str, tuple[int, bool]]

    max_async_calls: ClassVar[int] = 16
    """How many ``async def`` calls one rank runs at once. Async methods run on
    an event loop that each rank keeps running (in a thread of its own) from
    its first async call until it stops, so a task one call starts keeps
    running between calls. On backends with ``Capabilities.concurrent_async_calls``
    a rank starts its next calls while an async call awaits; elsewhere its
    calls still run one at a time (the loop keeps running between them)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__new__(cls)
        info = _constructing_rank.get()
        obj._podium_rank_info = info if info is not None else RankInfo.from_env()
        obj._podium_mesh = {}
        return obj

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        """``cuda_visible_devices``: a device list this rank uses (verl's argument).

        When given, it is set as ``CUDA_VISIBLE_DEVICES`` in the rank's process
        (on the inline backend: the controller's, which every rank shares) and
        :meth:`get_cuda_visible_devices` returns it. Backends give each rank of
        a ``use_gpu=True`` pool its device already; pass it only to override that.
        """
        if cuda_visible_devices is not None:
            if not isinstance(cuda_visible_devices, str):
                raise TypeError(
                    f"cuda_visible_devices must be a str such as '0,1', got {cuda_visible_devices!r}"
                )
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices

    @property
    def rank(self) -> int:
        return self._podium_rank_info.rank

    @property
    def world_size(self) -> int:
        return self._podium_rank_info.world_size

    @property
    def local_rank(self) -> int:
        return self._podium_rank_info.local_rank

    @property
    def local_world_size(self) -> int:
        return self._podium_rank_info.local_world_size

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this worker's place in the mesh ``mesh_name``.

        ``dp_rank`` is the data-parallel replica it belongs to; ``is_collect``
        marks the one rank per replica whose output is gathered (the others --
        TP/PP peers -- receive the same shard and their outputs are dropped).
        Each mesh is declared once per worker: a second declaration raises
        :class:`~podium.errors.DispatchError` (a ``ValueError``, and an ``AssertionError``
        as verl's check is).
        """
        if not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
        if mesh_name in self._podium_mesh:
            # A group reads each mesh's layout once and keeps it: a second
            # declaration would silently disagree with that cached layout.
            from podium.errors import DispatchError

            dp, collect = self._podium_mesh[mesh_name]
            raise DispatchError(
                f"mesh {mesh_name!r} is already registered on rank {self.rank} (dp_rank={dp}, "
                f"is_collect={collect}); register each mesh once per worker, or use another mesh name"
            )
        self._podium_mesh[mesh_name] = (dp_rank, bool(is_collect))

    def _query_dispatch_collect_info(self, mesh_name: str) -> tuple[int, bool] | None:
        return self._podium_mesh.get(mesh_name)

    def _mesh_place(self, mesh_name: str) -> tuple[int, bool]:
        place = self._podium_mesh.get(mesh_name)
        if place is None:
            raise ValueError(
                f"mesh {mesh_name!r} is not registered on rank {self.rank} of "
                f"{type(self).__qualname__} (registered: {sorted(self._podium_mesh)}); call "
                f"self._register_dispatch_collect_info({mesh_name!r}, dp_rank=..., is_collect=...) first"
            )
        return place

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        """This rank's DP rank in ``mesh_name``; through a group, the list of every rank's."""
        return self._mesh_place(mesh_name)[0]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's output is collected in ``mesh_name``; through a group, one per rank."""
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's output is collected in ``mesh_name`` (``ValueError`` if unregistered)."""
        return self._mesh_place(mesh_name)[1]

    def get_dispatch_collect(self) -> dict[str, dict[str, Any]]:
        """Every mesh this worker registered: ``{"dispatch_dp_rank": {mesh: dp_rank},
        "collect_dp_rank": {mesh: is_collect}}`` (copies; verl's shape)."""
        return {
            "dispatch_dp_rank": {name: dp for name, (dp, _) in self._podium_mesh.items()},
            "collect_dp_rank": {name: collect for name, (_, collect) in self._podium_mesh.items()},
        }

    def set_dispatch_collect(
        self,
        mesh_name: str,
        dispatch_dp_rank: Mapping[str, int],
        collect_dp_rank: Mapping[str, bool],
    ) -> None:
        """Register ``mesh_name`` with a place taken from another worker's :meth:`get_dispatch_collect`.

        A composite worker calls
        ``self.set_dispatch_collect("actor", **self.actor.get_dispatch_collect())``
        so that a group of composites dispatches like its sub-worker. The place
        is the one the source registered under ``mesh_name``, or its only mesh
        when it registered exactly one; anything else is ambiguous (``ValueError``).
        """
        dp = _pick_mesh_entry(mesh_name, dispatch_dp_rank, "dispatch_dp_rank")
        collect = _pick_mesh_entry(mesh_name, collect_dp_rank, "collect_dp_rank")
        self._register_dispatch_collect_info(mesh_name, int(dp), bool(collect))

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        """``(MASTER_ADDR, MASTER_PORT)`` of this group, as strings (``None`` where the backend has none)."""
        info = self._podium_rank_info
        port = str(info.master_port) if info.master_port is not None else None
        return info.master_addr, port

    def get_cuda_visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` of this rank's process, or ``"not set"``."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    def shutdown(self) -> None:
        """Release what this worker holds; called once on every rank when its group stops.

        Override it to close files, clients or process groups. Every backend calls
        it before the worker's process (or object) goes away -- on ``shutdown()``
        of the group and when a group is dropped without one -- and then lets the
        process exit normally, so ``atexit`` handlers run too. The backend waits a
        bounded time for it, then kills the process. An exception here is logged
        by the backend, never raised at the controller. Not called when the
        worker's process dies or is killed.
        """

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(self, *args, **kwargs)`` on every rank with its shard of the data."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` on rank zero and return its result."""
        return func(*args, **kwargs)


def _pick_mesh_entry(mesh_name: str, entries: Mapping[str, Any], what: str) -> Any:
    if not isinstance(entries, Mapping):
        raise TypeError(f"{what} must be a mapping of mesh name -> value, got {entries!r}")
    if mesh_name in entries:
        return entries[mesh_name]
    if len(entries) == 1:
        return next(iter(entries.values()))
    raise ValueError(
        f"set_dispatch_collect({mesh_name!r}): {what} has meshes {sorted(entries)}; it must "
        f"name {mesh_name!r} or hold exactly one mesh"
    )


class ClassWithInitArgs(Generic[T]):
    """A deferred constructor: the class and the arguments each rank builds it with."""

    def __init__(self, cls: type[T], *args: Any, **kwargs: Any) -> None:
        cls = _undecorated(cls)
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs needs a class, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> T:
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.cls.__qualname__})"


def _undecorated(cls: Any) -> Any:
    """The user's class behind a ``@ray.remote`` decoration (verl's workers carry one).

    podium starts the processes itself, on any backend, so it needs the plain
    class; read through Ray's own metadata without importing Ray.
    """
    modified = getattr(getattr(cls, "__ray_metadata__", None), "modified_class", None)
    original = getattr(modified, "__ray_actor_class__", None)
    return original if isinstance(original, type) else cls


@dataclass(frozen=True)
class Colocation:
    """The roles a colocated worker builds, by name: the argument of a colocated constructor."""

    roles: Mapping[str, ClassWithInitArgs[Any]]


def colocated_roles(cwa: ClassWithInitArgs[Any]) -> Mapping[str, ClassWithInitArgs[Any]] | None:
    """The roles of a constructor from :func:`create_colocated_worker_cls` or of a class from
    :func:`create_colocated_worker_raw_cls` (or a subclass); ``None`` for any other."""
    if not issubclass(cwa.cls, ColocatedWorker):
        return None
    if cwa.args and isinstance(cwa.args[0], Colocation):
        return cwa.args[0].roles
    if isinstance(cwa.cls.colocation, Colocation):
        return cwa.cls.colocation.roles
    return None


class ColocatedWorker(Worker):
    """Several roles' workers in one process per rank (see :func:`create_colocated_worker_cls`).

    ``roles`` maps each role's name to its worker object; each role is also
    an attribute of the same name (unless the class defines one) and, as in
    verl, ``fused_worker_dict`` is the same mapping, set on every role too, so
    roles can reach each other.
    """

    colocation: ClassVar[Colocation | None] = None
    """The roles a class from :func:`create_colocated_worker_raw_cls` builds."""

    def __init__(self, roles: Colocation | Mapping[str, ClassWithInitArgs[Any]] | None = None) -> None:
        super().__init__()
        if roles is None:
            roles = type(self).colocation
            if roles is None:
                raise TypeError(
                    f"{type(self).__qualname__} has no roles: build it with "
                    "create_colocated_worker_cls({...}) or subclass create_colocated_worker_raw_cls({...})"
                )
        if isinstance(roles, Colocation):
            roles = roles.roles
        self.roles: dict[str, Any] = {}
        for name, cwa in roles.items():
            self.roles[name] = cwa()
        self.fused_worker_dict = self.roles
        for name, role in self.roles.items():
            if not hasattr(self, name):
                setattr(self, name, role)
            try:
                role.fused_worker_dict = self.roles
            except AttributeError:  # a role class with __slots__ or a read-only attribute
                pass

    def get_fused_worker_by_name(self, worker_name: str) -> Any:
        """The role ``worker_name``, or ``None`` (verl's lookup)."""
        return self.roles.get(worker_name)

    def shutdown(self) -> None:
        """Shut each role down, in reverse order of construction; every role runs even if one fails."""
        errors: list[BaseException] = []
        for role in reversed(list(self.roles.values())):
            hook = getattr(role, "shutdown", None)
            if callable(hook):
                try:
                    hook()
                except Exception as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]


def user_classes(cwa: ClassWithInitArgs[Any]) -> list[type]:
    """The user classes a constructor builds: the class itself, and each colocated role's."""
    roles = colocated_roles(cwa)
    if roles is not None:
        own = [] if cwa.cls is ColocatedWorker else [cwa.cls]
        return own + [cls for role in roles.values() for cls in user_classes(role)]
    return [cwa.cls]


def create_colocated_worker_cls(class_dict: Mapping[str, ClassWithInitArgs[Any]]) -> ClassWithInitArgs[Any]:
    """Fuse several roles into one worker per rank.

    Start a group with the returned constructor, then ``wg.spawn(prefix_set=...)``
    gives each role its own view (a :class:`podium.WorkerGroup`) over the same processes.
    """
    return ClassWithInitArgs(ColocatedWorker, Colocation(_check_roles(class_dict)))


def create_colocated_worker_raw_cls(class_dict: Mapping[str, ClassWithInitArgs[Any]]) -> type[ColocatedWorker]:
    """A worker class (not a constructor) that builds every role of ``class_dict`` in one process per rank.

    Subclass it to add methods of the fused worker itself (they reach the roles
    as ``self.<role>``), then start a group with ``ClassWithInitArgs(MyFused)``.
    ``wg.fuse(roles)`` (or ``wg.spawn``) then gives each role its view over the
    same processes: ``wg.actor.update(...)`` runs the ``actor`` role's method.
    """
    roles = Colocation(_check_roles(class_dict))
    name = "_".join(["FusedWorker", *roles.roles])
    return type(name, (ColocatedWorker,), {"colocation": roles, "__module__": __name__, "__qualname__": name})


def _check_roles(class_dict: Mapping[str, ClassWithInitArgs[Any]]) -> dict[str, ClassWithInitArgs[Any]]:
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    for name, cwa in class_dict.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"role names must be non-empty strings without ':', got {name!r}")
        if not isinstance(cwa, ClassWithInitArgs):
            raise TypeError(f"role {name!r} must map to a ClassWithInitArgs, got {cwa!r}")
    return dict(class_dict)
