"""Dispatch modes: the names, the records, and the registry that maps one to the other.

A leaf module (it imports nothing else of podium's core), so that every layer
can name a mode. :mod:`podium.core.dispatch` registers the built-in modes'
functions here; :func:`podium.register` records a :class:`MethodSpec` that
refers to a mode by name, looked up at call time so updates apply.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Dispatch",
    "DispatchMode",
    "Execute",
    "MethodSpec",
    "register_dispatch_mode",
    "resolve_dispatch_mode",
    "update_dispatch_mode",
]


class Dispatch(enum.Enum):
    """Built-in dispatch modes (how arguments are split, how outputs are gathered)."""

    ONE_TO_ALL = "one_to_all"
    """Every rank gets the same arguments; result: list of per-rank outputs."""
    ALL_TO_ALL = "all_to_all"
    """Arguments go as given (the per-rank slicing rule applies); result: list."""
    RANK_ZERO = "rank_zero"
    """Only rank 0 runs, with the arguments as given; result: its return value."""
    DP_COMPUTE = "dp_compute"
    """Every argument is a list of length world_size; rank i gets element i; result: list."""
    DP_COMPUTE_PROTO = "dp_compute_proto"
    """DataProto/TensorDict arguments are chunked over ranks; result: the concatenation."""
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    """Like DP_COMPUTE_PROTO; the first argument (a function) goes to every rank whole."""
    DP_COMPUTE_METRIC = "dp_compute_metric"
    """Data chunked like DP_COMPUTE_PROTO; result: the list of per-rank outputs."""


class Execute(enum.Enum):
    """Which ranks run a call."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DispatchMode:
    """A named dispatch mode: its dispatch and collect functions.

    ``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)`` and
    ``collect_fn(worker_group, outputs) -> result``. ``dp`` marks modes whose
    non-blocking calls return a :class:`podium.DataProtoFuture`.
    """

    name: str
    dispatch_fn: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]
    collect_fn: Callable[[Any, list[Any]], Any]
    dp: bool = False
    mesh_name: str | None = None


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` recorded for one method."""

    dispatch_mode: Dispatch | str | DispatchMode
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    timeout: float | None
    is_async: bool


_registry_lock = threading.Lock()
_modes: dict[Any, DispatchMode] = {}


def register_builtin_modes(modes: dict[Dispatch, DispatchMode]) -> None:
    """Install the built-in modes' functions (called once, by :mod:`podium.core.dispatch`)."""
    with _registry_lock:
        for mode, record in modes.items():
            _modes.setdefault(mode, record)


def register_dispatch_mode(
    name: str,
    dispatch_fn: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]],
    collect_fn: Callable[[Any, list[Any]], Any],
) -> str:
    """Add a custom dispatch mode; use ``@register(dispatch_mode=name)`` afterwards."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a dispatch mode name must be a non-empty string, got {name!r}")
    _check_callables(name, dispatch_fn, collect_fn)
    with _registry_lock:
        if name in _modes or name.upper() in Dispatch.__members__:
            raise ValueError(
                f"dispatch mode {name!r} is already registered; use update_dispatch_mode() to replace it"
            )
        _modes[name] = DispatchMode(name, dispatch_fn, collect_fn)
    return name


def update_dispatch_mode(
    mode: Dispatch | str,
    dispatch_fn: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]],
    collect_fn: Callable[[Any, list[Any]], Any],
) -> None:
    """Replace the functions of an existing (built-in or custom) dispatch mode."""
    _check_callables(str(mode), dispatch_fn, collect_fn)
    with _registry_lock:
        if mode not in _modes:
            raise ValueError(
                f"unknown dispatch mode {mode!r}; register it with register_dispatch_mode()"
            )
        old = _modes[mode]
        _modes[mode] = DispatchMode(old.name, dispatch_fn, collect_fn, dp=old.dp)


def _check_callables(name: str, dispatch_fn: Any, collect_fn: Any) -> None:
    if not callable(dispatch_fn) or not callable(collect_fn):
        raise TypeError(
            f"dispatch mode {name!r} needs callable dispatch_fn(worker_group, *args, **kwargs) "
            "and collect_fn(worker_group, outputs)"
        )


def resolve_dispatch_mode(mode: Dispatch | str | DispatchMode) -> DispatchMode:
    """The dispatch mode record for ``mode`` (looked up at call time, so updates apply)."""
    if isinstance(mode, DispatchMode):
        return mode
    try:
        return _modes[mode]
    except KeyError:
        known = [m.name for m in Dispatch] + [k for k in _modes if isinstance(k, str)]
        raise ValueError(f"unknown dispatch mode {mode!r}; known modes: {known}") from None
