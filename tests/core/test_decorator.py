"""@register validates when the decorator runs and stores a typed, frozen record."""

from __future__ import annotations

import dataclasses

import pytest

from podium import Dispatch, Execute, register, register_dispatch_mode
from podium.core.decorator import MethodSpec, get_method_spec, resolve_dispatch_mode


def test_spec_is_frozen_and_typed() -> None:
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False, timeout=3)
    def f(self): ...

    spec = get_method_spec(f)
    assert isinstance(spec, MethodSpec)
    assert spec.dispatch_mode is Dispatch.DP_COMPUTE_PROTO and spec.blocking is False and spec.timeout == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.blocking = True  # type: ignore[misc]


def test_async_methods_are_recognised() -> None:
    @register()
    async def f(self): ...

    assert get_method_spec(f).is_async  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dispatch_mode": "nope"}, ValueError, "unknown dispatch mode"),
        ({"dispatch_mode": 3}, ValueError, "dispatch_mode must be"),
        ({"dispatch_mode": {"dispatch_fn": print}}, ValueError, "exactly the keys"),
        ({"dispatch_mode": {"dispatch_fn": 1, "collect_fn": 2}}, TypeError, "callable"),
        ({"execute_mode": "all"}, ValueError, "execute_mode"),
        ({"blocking": "yes"}, TypeError, "bools"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"dispatch_mode": Dispatch.DP_COMPUTE_PROTO, "execute_mode": Execute.RANK_ZERO}, ValueError, "rank zero"),
    ],
)
def test_bad_arguments_fail_at_decoration(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        register(**kwargs)


def test_double_register_is_refused() -> None:
    with pytest.raises(ValueError, match="already decorated"):

        @register()
        @register()
        def f(self): ...


def test_custom_mode_by_name_and_update() -> None:
    def d(wg, *a, **k):
        return a, k

    def c(wg, outs):
        return outs

    register_dispatch_mode("decorator_test_mode", d, c)
    assert resolve_dispatch_mode("decorator_test_mode").dispatch_fn is d

    @register(dispatch_mode="decorator_test_mode")
    def f(self): ...

    assert get_method_spec(f).dispatch_mode == "decorator_test_mode"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="non-empty"):
        register_dispatch_mode("", d, c)
