"""Dispatch modes: their names, their records, and the registry mapping one to the other.

A leaf module (it imports nothing of podium's core), so that every layer can
name a mode. :mod:`podium.core.dispatch` registers the built-in modes'
functions here; :func:`podium.register` records a :class:`MethodSpec` naming a
mode, which a group looks up at call time (so updates apply to methods
decorated before them).

The contract of a mode's functions:

- ``dispatch_fn(group, *args, **kwargs)`` returns ``(args, kwargs)`` for the
  ranks: each value is a list of length ``world_size`` when it differs by rank
  (the per-rank slicing rule), else it goes whole to every rank. A mode that
  padded data returns :class:`Dispatched` ``(args, kwargs, pad=rows)``; the
  group removes ``rows`` rows from the collected result, blocking or not.
- ``collect_fn(group, outputs)`` turns the per-rank outputs into the result.
- ``group`` is a :class:`DispatchGroup`: ``world_size`` and ``mesh_layout()``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from podium.errors import DispatchError

__all__ = [
    "DISPATCH_MODE_FN_REGISTRY",
    "Dispatch",
    "DispatchGroup",
    "DispatchMode",
    "Dispatched",
    "Execute",
    "MeshLayout",
    "MethodSpec",
    "check_output_options",
    "get_predefined_dispatch_fn",
    "get_predefined_execute_fn",
    "register_dispatch_mode",
    "resolve_dispatch_mode",
    "update_dispatch_mode",
]


class _DispatchMeta(type):
    """Makes :class:`Dispatch` iterable and indexable by name, like an enum that can grow."""

    _members: dict[str, Dispatch]

    def __iter__(cls) -> Iterator[Dispatch]:
        return iter(list(cls._members.values()))

    def __len__(cls) -> int:
        return len(cls._members)

    def __contains__(cls, item: object) -> bool:
        if isinstance(item, str):
            return item.upper() in cls._members
        return any(item is m for m in cls._members.values())

    def __getitem__(cls, name: str) -> Dispatch:
        return cls._members[name.upper()]

    @property
    def __members__(cls) -> dict[str, Dispatch]:
        return dict(cls._members)

    def __getattr__(cls, name: str) -> Dispatch:
        # Only reached for names that are not (yet) members.
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"Dispatch has no mode {name!r}; add it with register_dispatch_mode({name!r}, "
            f"dispatch_fn, collect_fn) before using it. Modes: {sorted(cls._members)}"
        )


class Dispatch(metaclass=_DispatchMeta):
    """Dispatch modes: how a call's arguments are split over ranks, how outputs are gathered.

    An enum that grows: :func:`register_dispatch_mode` adds ``Dispatch.NAME``
    (names are upper-cased, as verl does). Members compare by identity, pickle
    by name, and iterate in registration order.
    """

    ONE_TO_ALL: ClassVar[Dispatch]
    """Every rank gets the same arguments; result: list of per-rank outputs."""
    ALL_TO_ALL: ClassVar[Dispatch]
    """Arguments go as given (the per-rank slicing rule applies); result: list."""
    RANK_ZERO: ClassVar[Dispatch]
    """Only rank 0 runs, with the arguments as given; result: its return value."""
    DP_COMPUTE: ClassVar[Dispatch]
    """Every argument is a list of length world_size; rank i gets element i; result: list."""
    DP_COMPUTE_PROTO: ClassVar[Dispatch]
    """Batch arguments are chunked over ranks; result: the concatenation."""
    DP_COMPUTE_PROTO_WITH_FUNC: ClassVar[Dispatch]
    """Like DP_COMPUTE_PROTO; the first argument (a function) goes to every rank whole."""
    DP_COMPUTE_METRIC: ClassVar[Dispatch]
    """Batches chunked like DP_COMPUTE_PROTO (never padded); result: the list of per-rank outputs."""

    _members: ClassVar[dict[str, Dispatch]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()
    name: str
    value: str

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = value

    @classmethod
    def register(cls, name: str) -> Dispatch:
        """Add the member ``Dispatch.<NAME>``; ``ValueError`` if it exists."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a dispatch mode name must be a Python identifier, got {name!r}")
        key = name.upper()
        with cls._lock:
            if key in cls._members:
                raise ValueError(f"Dispatch.{key} already exists")
            member = cls(key, name.lower())
            cls._members[key] = member
            type.__setattr__(cls, key, member)
        return member

    @classmethod
    def remove(cls, name: str) -> Dispatch:
        """Remove a member (and its registry entry); the built-in modes cannot be removed."""
        key = name.upper()
        if key in _BUILTIN_NAMES:
            raise ValueError(f"Dispatch.{key} is built in and cannot be removed")
        with cls._lock:
            member = cls._members.pop(key)
            type.__delattr__(cls, key)
        DISPATCH_MODE_FN_REGISTRY.pop(member, None)
        return member

    @classmethod
    def from_name(cls, name: str) -> Dispatch | None:
        return cls._members.get(name.upper())

    @classmethod
    def names(cls) -> list[str]:
        return list(cls._members)

    def __repr__(self) -> str:
        return f"<Dispatch.{self.name}: {self.value!r}>"

    def __str__(self) -> str:
        return f"Dispatch.{self.name}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_member, (self.name,))


def _member(name: str) -> Dispatch:
    """Unpickle a member: the same object in this process, added here if only the sender had it."""
    found = Dispatch.from_name(name)
    if found is not None:
        return found
    try:
        return Dispatch.register(name)
    except ValueError:  # registered by another thread meanwhile
        return Dispatch[name]


_BUILTIN_NAMES = (
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "RANK_ZERO",
    "DP_COMPUTE",
    "DP_COMPUTE_PROTO",
    "DP_COMPUTE_PROTO_WITH_FUNC",
    "DP_COMPUTE_METRIC",
)
for _name in _BUILTIN_NAMES:
    Dispatch.register(_name)

# Built-in modes whose non-blocking calls return a DataProtoFuture.
_DP_MODES = frozenset({Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_PROTO_WITH_FUNC})


class Execute(enum.Enum):
    """Which ranks run a call."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True, eq=False)
class DispatchMode(Mapping[str, Any]):
    """A dispatch mode's functions, readable like verl's ``{"dispatch_fn": ..., "collect_fn": ...}``.

    ``dp`` marks modes whose non-blocking calls return a
    :class:`podium.DataProtoFuture`; ``mesh_name`` the nd-mesh a mode splits over.
    It compares equal to any mapping with the same two functions.
    """

    name: str
    dispatch_fn: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]
    collect_fn: Callable[[Any, list[Any]], Any]
    dp: bool = False
    mesh_name: str | None = None

    _KEYS: ClassVar[tuple[str, str]] = ("dispatch_fn", "collect_fn")

    def __getitem__(self, key: str) -> Any:
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return 2

    __hash__ = object.__hash__


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` recorded for one method."""

    dispatch_mode: Dispatch | str | DispatchMode
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    timeout: float | None
    is_async: bool
    output: str = "value"
    row_meta: tuple[str, ...] = ()


class Dispatched(tuple[tuple[Any, ...], dict[str, Any]]):
    """What a dispatch function returns when it padded data: ``(args, kwargs)`` plus ``pad``.

    It unpacks as the plain pair, so code that calls a dispatch function
    directly keeps working; the group reads ``pad`` (0 for a plain tuple) and
    removes that many rows from the collected result.
    """

    pad: int

    def __new__(cls, args: Sequence[Any], kwargs: Mapping[str, Any], pad: int = 0) -> Dispatched:
        if not isinstance(pad, int) or pad < 0:
            raise ValueError(
                f"pad must be an int >= 0 (rows to remove from the result), got {pad!r}"
            )
        self = super().__new__(cls, (tuple(args), dict(kwargs)))
        self.pad = pad
        return self


def pad_of(dispatched: Any) -> int:
    """The rows a dispatch function's result says it padded (0 for a plain tuple)."""
    return int(getattr(dispatched, "pad", 0))


@dataclass(frozen=True)
class MeshLayout:
    """Where each rank sits in one registered mesh."""

    dp_ranks: list[int]  # rank -> dp rank
    collect_ranks: list[int]  # the collecting rank of each dp rank, in dp order

    @property
    def dp_size(self) -> int:
        return len(self.collect_ranks)

    @classmethod
    def from_infos(cls, mesh_name: str, infos: Sequence[tuple[int, bool] | None]) -> MeshLayout:
        missing = [r for r, info in enumerate(infos) if info is None]
        if missing:
            raise DispatchError(
                f"ranks {missing} never declared their place in mesh {mesh_name!r}; call "
                f"self._register_dispatch_collect_info({mesh_name!r}, dp_rank=..., is_collect=...) "
                "in every worker (e.g. in __init__ or an init method) before using this dispatch mode"
            )
        pairs = [info for info in infos if info is not None]
        dp_ranks = [dp for dp, _ in pairs]
        dp_size = max(dp_ranks) + 1
        collect: dict[int, list[int]] = {}
        for rank, (dp, is_collect) in enumerate(pairs):
            if is_collect:
                collect.setdefault(dp, []).append(rank)
        bad = [d for d in range(dp_size) if len(collect.get(d, [])) != 1]
        if bad:
            raise DispatchError(
                f"mesh {mesh_name!r}: each DP rank needs exactly one is_collect rank; DP ranks {bad} "
                f"have {[collect.get(d, []) for d in bad]}"
            )
        return cls(dp_ranks, [collect[d][0] for d in range(dp_size)])


class DispatchGroup(Protocol):
    """What dispatch and collect functions may use of the group they run for."""

    @property
    def world_size(self) -> int: ...

    def mesh_layout(self, mesh_name: str) -> MeshLayout:
        """Each rank's place in ``mesh_name``, as the workers registered it (asked once, then kept)."""
        ...


DISPATCH_MODE_FN_REGISTRY: dict[Dispatch, Mapping[str, Any]] = {}
"""Mode -> its functions (a :class:`DispatchMode`, or any mapping with
``dispatch_fn`` and ``collect_fn``). Code may read, copy and restore it, as
verl's registry of the same name; groups read it at every call."""

_registry_lock = threading.Lock()


def register_builtin_modes(modes: Mapping[Dispatch, DispatchMode]) -> None:
    """Install the built-in modes' functions (called once, by :mod:`podium.core.dispatch`)."""
    with _registry_lock:
        for mode, record in modes.items():
            DISPATCH_MODE_FN_REGISTRY.setdefault(mode, record)


def register_dispatch_mode(
    name: str,
    dispatch_fn: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]],
    collect_fn: Callable[[Any, list[Any]], Any],
) -> Dispatch:
    """Add a dispatch mode: ``Dispatch.<NAME>`` (or the string ``name``) then works in ``@register``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a dispatch mode name must be a non-empty string, got {name!r}")
    _check_callables(name, dispatch_fn, collect_fn)
    with _registry_lock:
        member = Dispatch.from_name(name)
        if member is not None and member in DISPATCH_MODE_FN_REGISTRY:
            raise ValueError(
                f"dispatch mode {name!r} is already registered; use update_dispatch_mode() to replace it"
            )
        if member is None:
            member = Dispatch.register(name)
        DISPATCH_MODE_FN_REGISTRY[member] = DispatchMode(member.name, dispatch_fn, collect_fn)
    return member


def update_dispatch_mode(
    mode: Dispatch | str,
    dispatch_fn: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]],
    collect_fn: Callable[[Any, list[Any]], Any],
) -> None:
    """Replace the functions of an existing (built-in or custom) dispatch mode."""
    _check_callables(str(mode), dispatch_fn, collect_fn)
    with _registry_lock:
        member = _member_of(mode)
        if member is None or member not in DISPATCH_MODE_FN_REGISTRY:
            raise ValueError(
                f"unknown dispatch mode {mode!r}; register it with register_dispatch_mode()"
            )
        old = DISPATCH_MODE_FN_REGISTRY[member]
        dp = old.dp if isinstance(old, DispatchMode) else member in _DP_MODES
        DISPATCH_MODE_FN_REGISTRY[member] = DispatchMode(
            member.name, dispatch_fn, collect_fn, dp=dp
        )


def _member_of(mode: Any) -> Dispatch | None:
    if isinstance(mode, Dispatch):
        return mode
    if isinstance(mode, str):
        return Dispatch.from_name(mode)
    return None


def _check_callables(name: str, dispatch_fn: Any, collect_fn: Any) -> None:
    if not callable(dispatch_fn) or not callable(collect_fn):
        raise TypeError(
            f"dispatch mode {name!r} needs callable dispatch_fn(worker_group, *args, **kwargs) "
            "and collect_fn(worker_group, outputs)"
        )


def resolve_dispatch_mode(mode: Dispatch | str | Mapping[str, Any]) -> DispatchMode:
    """The functions of ``mode`` as the registry holds them now."""
    if isinstance(mode, DispatchMode):
        return mode
    member = _member_of(mode)
    entry = DISPATCH_MODE_FN_REGISTRY.get(member) if member is not None else None
    if member is None or entry is None:
        known = [m.name for m in Dispatch if m in DISPATCH_MODE_FN_REGISTRY]
        raise ValueError(f"unknown dispatch mode {mode!r}; known modes: {known}")
    if isinstance(entry, DispatchMode):
        return entry
    try:
        return DispatchMode(
            member.name, entry["dispatch_fn"], entry["collect_fn"], dp=member in _DP_MODES
        )
    except (KeyError, TypeError):
        raise ValueError(
            f"DISPATCH_MODE_FN_REGISTRY[{member}] must map 'dispatch_fn' and 'collect_fn', got {entry!r}"
        ) from None


def get_predefined_dispatch_fn(mode: Dispatch | str) -> DispatchMode:
    """``{"dispatch_fn": ..., "collect_fn": ...}`` of a registered mode (verl's name for the lookup)."""
    return resolve_dispatch_mode(mode)


def get_predefined_execute_fn(execute_mode: Execute) -> dict[str, str]:
    """``{"execute_fn_name": ...}``: the group method that runs ``execute_mode`` (verl's lookup)."""
    names = {Execute.ALL: "execute_all", Execute.RANK_ZERO: "execute_rank_zero"}
    if execute_mode not in names:
        raise ValueError(
            f"execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {execute_mode!r}"
        )
    return {"execute_fn_name": names[execute_mode]}


OUTPUTS = ("value", "ref")


def check_output_options(output: Any, row_meta: Any, blocking: bool) -> tuple[str, ...]:
    """Validate ``register(output=..., row_meta=...)``; the row_meta keys as a tuple."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be 'value' or 'ref', got {output!r}")
    if isinstance(row_meta, str) or not all(isinstance(k, str) for k in row_meta):
        raise TypeError(f"row_meta must be a list of key names, got {row_meta!r}")
    if row_meta and output != "ref":
        raise ValueError("row_meta is published only with output='ref'")
    if output == "ref" and not blocking:
        raise ValueError(
            "output='ref' needs blocking=True: the call returns the BatchRef (metadata) at once "
            "after the ranks finish; pass the BatchRef on instead of a future"
        )
    return tuple(row_meta)
