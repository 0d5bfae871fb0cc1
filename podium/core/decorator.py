"""``@register``: how a worker method is split across ranks and gathered back.

The decorator validates its arguments when it runs and stores a frozen
:class:`MethodSpec` on the function; :class:`podium.WorkerGroup` reads it to
build the group's methods, and the worker host reads it to know whether to
materialize futures.
"""

from __future__ import annotations

import enum
import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "Dispatch",
    "DispatchMode",
    "Execute",
    "MethodSpec",
    "get_method_spec",
    "register",
    "register_dispatch_mode",
    "resolve_dispatch_mode",
    "update_dispatch_mode",
]

SPEC_ATTR = "__podium_method_spec__"

F = TypeVar("F", bound=Callable[..., Any])


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


def _builtin_modes() -> None:
    from podium.core import dispatch as d

    _modes.update(
        {
            Dispatch.ONE_TO_ALL: DispatchMode("ONE_TO_ALL", d.dispatch_one_to_all, d.collect_all_to_all),
            Dispatch.ALL_TO_ALL: DispatchMode("ALL_TO_ALL", d.dispatch_all_to_all, d.collect_all_to_all),
            Dispatch.RANK_ZERO: DispatchMode("RANK_ZERO", d.dispatch_all_to_all, d.collect_rank_zero),
            Dispatch.DP_COMPUTE: DispatchMode("DP_COMPUTE", d.dispatch_dp_compute, d.collect_all_to_all),
            Dispatch.DP_COMPUTE_PROTO: DispatchMode(
                "DP_COMPUTE_PROTO", d.dispatch_dp_compute_data_proto, d.collect_dp_compute_data_proto, dp=True
            ),
            Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: DispatchMode(
                "DP_COMPUTE_PROTO_WITH_FUNC",
                d.dispatch_dp_compute_data_proto_with_func,
                d.collect_dp_compute_data_proto,
                dp=True,
            ),
            Dispatch.DP_COMPUTE_METRIC: DispatchMode(
                "DP_COMPUTE_METRIC", d.dispatch_dp_compute_metric, d.collect_all_to_all
            ),
        }
    )


def _ensure_builtins() -> None:
    if not _modes:
        with _registry_lock:
            if not _modes:
                _builtin_modes()


def register_dispatch_mode(
    name: str,
    dispatch_fn: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]],
    collect_fn: Callable[[Any, list[Any]], Any],
) -> str:
    """Add a custom dispatch mode; use ``@register(dispatch_mode=name)`` afterwards."""
    _ensure_builtins()
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
    _ensure_builtins()
    _check_callables(str(mode), dispatch_fn, collect_fn)
    with _registry_lock:
        if mode not in _modes:
            raise ValueError(f"unknown dispatch mode {mode!r}; register it with register_dispatch_mode()")
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
    _ensure_builtins()
    try:
        return _modes[mode]
    except KeyError:
        known = [m.name for m in Dispatch] + [k for k in _modes if isinstance(k, str)]
        raise ValueError(f"unknown dispatch mode {mode!r}; known modes: {known}") from None


def _normalize_dispatch_mode(mode: Any) -> Dispatch | str | DispatchMode:
    if isinstance(mode, Dispatch):
        return mode
    if isinstance(mode, Mapping):
        keys = set(mode)
        if keys != {"dispatch_fn", "collect_fn"}:
            raise ValueError(
                "a dict dispatch_mode must have exactly the keys 'dispatch_fn' and 'collect_fn', "
                f"got {sorted(map(str, keys))}"
            )
        _check_callables("<dict>", mode["dispatch_fn"], mode["collect_fn"])
        return DispatchMode(
            getattr(mode["dispatch_fn"], "__name__", "custom"), mode["dispatch_fn"], mode["collect_fn"]
        )
    if isinstance(mode, DispatchMode):
        return mode
    if isinstance(mode, str):
        resolve_dispatch_mode(mode)  # raises for unknown names
        return mode
    raise ValueError(
        f"dispatch_mode must be a Dispatch member, a registered mode name or a dict with "
        f"'dispatch_fn' and 'collect_fn', got {mode!r}"
    )


def register(
    dispatch_mode: Dispatch | str | Mapping[str, Callable[..., Any]] | DispatchMode = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    *,
    timeout: float | None = None,
) -> Callable[[F], F]:
    """Mark a worker method as callable through a :class:`podium.WorkerGroup`.

    Arguments are checked here, when the class body runs, not at the first call.
    """
    mode = _normalize_dispatch_mode(dispatch_mode)
    if not isinstance(execute_mode, Execute):
        raise ValueError(f"execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {execute_mode!r}")
    if not isinstance(blocking, bool) or not isinstance(materialize_futures, bool):
        raise TypeError("blocking and materialize_futures must be bools")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if execute_mode is Execute.RANK_ZERO and isinstance(mode, Dispatch) and mode in _DP_SPLITTING:
        raise ValueError(
            f"{mode} splits data over every rank; it cannot run on rank zero only. "
            "Use Dispatch.ONE_TO_ALL/ALL_TO_ALL with Execute.RANK_ZERO, or Execute.ALL."
        )

    def decorate(func: F) -> F:
        if not callable(func):
            raise TypeError(f"@register decorates a method, got {func!r}")
        if hasattr(func, SPEC_ATTR):
            raise ValueError(f"{func.__qualname__} is already decorated with @register")
        spec = MethodSpec(
            dispatch_mode=mode,
            execute_mode=execute_mode,
            blocking=blocking,
            materialize_futures=materialize_futures,
            timeout=float(timeout) if timeout is not None else None,
            is_async=inspect.iscoroutinefunction(func),
        )
        setattr(func, SPEC_ATTR, spec)
        return func

    return decorate


_DP_SPLITTING = {
    Dispatch.DP_COMPUTE,
    Dispatch.DP_COMPUTE_PROTO,
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC,
    Dispatch.DP_COMPUTE_METRIC,
}


def get_method_spec(func: Any) -> MethodSpec | None:
    """The :class:`MethodSpec` of a ``@register``-ed function (or bound method), else None."""
    func = getattr(func, "__func__", func)
    if isinstance(func, functools.partial):
        func = func.func
    spec = getattr(func, SPEC_ATTR, None)
    return spec if isinstance(spec, MethodSpec) else None
