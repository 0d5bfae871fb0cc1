"""``@register``: how a worker method is split across ranks and gathered back.

The decorator validates its arguments when it runs and stores a frozen
:class:`MethodSpec` on the function; :class:`podium.WorkerGroup` reads it to
build the group's methods, and the worker host reads it to know whether to
materialize futures.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

# Importing dispatch installs the built-in modes' functions in the registry.
from podium.core import dispatch as _builtin_modes  # noqa: F401
from podium.core.modes import (
    DISPATCH_MODE_FN_REGISTRY,
    Dispatch,
    DispatchMode,
    Execute,
    MethodSpec,
    _check_callables,
    check_output_options,
    get_predefined_dispatch_fn,
    get_predefined_execute_fn,
    register_dispatch_mode,
    resolve_dispatch_mode,
    update_dispatch_mode,
)

__all__ = [
    "DISPATCH_MODE_FN_REGISTRY",
    "Dispatch",
    "DispatchMode",
    "Execute",
    "MethodSpec",
    "get_method_spec",
    "get_predefined_dispatch_fn",
    "get_predefined_execute_fn",
    "register",
    "register_dispatch_mode",
    "resolve_dispatch_mode",
    "update_dispatch_mode",
]

SPEC_ATTR = "__podium_method_spec__"

F = TypeVar("F", bound=Callable[..., Any])


def _normalize_dispatch_mode(mode: Any) -> Dispatch | str | DispatchMode:
    if isinstance(mode, (Dispatch, DispatchMode)):
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
    if isinstance(mode, str):
        resolve_dispatch_mode(mode)  # raises for unknown names
        return mode
    raise ValueError(
        f"dispatch_mode must be a Dispatch member, a registered mode name or a dict with "
        f"'dispatch_fn' and 'collect_fn', got {mode!r}"
    )


def _check_dispatch_mode(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is a usable dispatch mode (verl's check, for ported code)."""
    _normalize_dispatch_mode(mode)


def register(
    dispatch_mode: Dispatch | str | Mapping[str, Callable[..., Any]] | DispatchMode = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    *,
    timeout: float | None = None,
    output: str = "value",
    row_meta: tuple[str, ...] | list[str] = (),
) -> Callable[[F], F]:
    """Mark a worker method as callable through a :class:`podium.WorkerGroup`.

    Arguments are checked here, when the class body runs, not at the first call.
    ``output="ref"`` makes the call return a :class:`podium.BatchRef`: the
    ranks keep their outputs and only metadata reaches the controller;
    ``row_meta`` names 1-D keys of the output whose per-row values the
    reference carries (see :mod:`podium.core.batchref`).
    """
    mode = _normalize_dispatch_mode(dispatch_mode)
    row_meta = check_output_options(output, row_meta, blocking)
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
            output=output,
            row_meta=row_meta,
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
