"""The worker side: the user's ``Worker`` base class and deferred constructors."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from podium.core.decorator import Dispatch, Execute, register

__all__ = [
    "ClassWithInitArgs",
    "ColocatedWorker",
    "Colocation",
    "RankInfo",
    "Worker",
    "colocated_roles",
    "create_colocated_worker_cls",
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

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__new__(cls)
        info = _constructing_rank.get()
        obj._podium_rank_info = info if info is not None else RankInfo.from_env()
        obj._podium_mesh = {}
        return obj

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
    """The roles of a constructor from :func:`create_colocated_worker_cls`; ``None`` for any other."""
    if issubclass(cwa.cls, ColocatedWorker) and cwa.args and isinstance(cwa.args[0], Colocation):
        return cwa.args[0].roles
    return None


class ColocatedWorker(Worker):
    """Several roles' workers in one process per rank (see :func:`create_colocated_worker_cls`)."""

    def __init__(self, roles: Colocation | Mapping[str, ClassWithInitArgs[Any]]) -> None:
        if isinstance(roles, Colocation):
            roles = roles.roles
        self.roles: dict[str, Any] = {}
        for name, cwa in roles.items():
            self.roles[name] = cwa()

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
    """The user classes a constructor builds: the class itself, or each colocated role's."""
    roles = colocated_roles(cwa)
    if roles is not None:
        return [cls for role in roles.values() for cls in user_classes(role)]
    return [cwa.cls]


def create_colocated_worker_cls(class_dict: Mapping[str, ClassWithInitArgs[Any]]) -> ClassWithInitArgs[Any]:
    """Fuse several roles into one worker per rank.

    Start a group with the returned constructor, then ``wg.spawn(prefix_set=...)``
    gives each role its own view (a :class:`podium.WorkerGroup`) over the same processes.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    for name, cwa in class_dict.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"role names must be non-empty strings without ':', got {name!r}")
        if not isinstance(cwa, ClassWithInitArgs):
            raise TypeError(f"role {name!r} must map to a ClassWithInitArgs, got {cwa!r}")
    return ClassWithInitArgs(ColocatedWorker, Colocation(dict(class_dict)))
