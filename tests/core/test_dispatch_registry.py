"""The dispatch registry as verl code reads it, custom modes that pad, and pluggable batch types."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from podium import (
    DISPATCH_MODE_FN_REGISTRY,
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    Dispatched,
    Execute,
    ResourcePool,
    Worker,
    WorkerGroup,
    get_predefined_dispatch_fn,
    get_predefined_execute_fn,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_batch_type,
    register_dispatch_mode,
    update_dispatch_mode,
)
from podium.core.dispatch import collect_all_to_all, dispatch_one_to_all
from podium.errors import DispatchError


@pytest.fixture
def restored_registry() -> Iterator[None]:
    saved = DISPATCH_MODE_FN_REGISTRY.copy()
    yield
    DISPATCH_MODE_FN_REGISTRY.clear()
    DISPATCH_MODE_FN_REGISTRY.update(saved)


def first_rank_only(wg: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple([a] + [None] * (wg.world_size - 1) for a in args), {}


def keep_first(wg: Any, outputs: list[Any]) -> Any:
    return outputs[0]


def test_registered_mode_is_a_dispatch_member_usable_in_register(restored_registry: None) -> None:
    member = register_dispatch_mode("REGISTRY_TEST_MODE", first_rank_only, keep_first)
    try:
        assert member is Dispatch.REGISTRY_TEST_MODE and "REGISTRY_TEST_MODE" in Dispatch
        assert DISPATCH_MODE_FN_REGISTRY[Dispatch.REGISTRY_TEST_MODE] == {
            "dispatch_fn": first_rank_only,
            "collect_fn": keep_first,
        }
        assert pickle.loads(pickle.dumps(member)) is member
        assert copy.deepcopy(member) is member

        class W(Worker):
            @register(dispatch_mode=Dispatch.REGISTRY_TEST_MODE)
            def echo(self, value: Any) -> Any:
                return (self.rank, value)

        with WorkerGroup(
            ResourcePool([3], use_gpu=False), ClassWithInitArgs(W), backend="inline"
        ) as wg:
            assert wg.echo("x") == (0, "x")
        with pytest.raises(ValueError, match="already registered"):
            register_dispatch_mode("REGISTRY_TEST_MODE", first_rank_only, keep_first)
    finally:
        Dispatch.remove("REGISTRY_TEST_MODE")
    assert "REGISTRY_TEST_MODE" not in Dispatch
    with pytest.raises(AttributeError, match="register_dispatch_mode"):
        Dispatch.REGISTRY_TEST_MODE  # noqa: B018


def test_the_registry_can_be_copied_updated_and_restored(restored_registry: None) -> None:
    saved = DISPATCH_MODE_FN_REGISTRY.copy()
    update_dispatch_mode(Dispatch.ONE_TO_ALL, first_rank_only, keep_first)
    assert DISPATCH_MODE_FN_REGISTRY[Dispatch.ONE_TO_ALL]["dispatch_fn"] is first_rank_only

    class W(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def rank_of(self, _: Any = None) -> int:
            return self.rank

    with WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(W), backend="inline"
    ) as wg:
        assert wg.rank_of("x") == 0  # the updated functions apply to methods decorated before
        DISPATCH_MODE_FN_REGISTRY.clear()
        DISPATCH_MODE_FN_REGISTRY.update(saved)
        assert wg.rank_of("x") == [0, 1]
        # A plain dict entry (as verl code writes them) works too.
        DISPATCH_MODE_FN_REGISTRY[Dispatch.ONE_TO_ALL] = {
            "dispatch_fn": first_rank_only,
            "collect_fn": keep_first,
        }
        assert wg.rank_of("x") == 0


def test_predefined_lookups_and_nd_mode_index_like_verl_dicts() -> None:
    fns = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)
    assert fns["dispatch_fn"] is dispatch_one_to_all and fns["collect_fn"] is collect_all_to_all
    assert dict(fns) == {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all}
    assert get_predefined_execute_fn(Execute.ALL) == {"execute_fn_name": "execute_all"}
    assert get_predefined_execute_fn(Execute.RANK_ZERO) == {"execute_fn_name": "execute_rank_zero"}
    nd = make_nd_compute_dataproto_dispatch_fn("registry_mesh")
    assert (
        callable(nd["dispatch_fn"])
        and callable(nd["collect_fn"])
        and set(nd) == {"dispatch_fn", "collect_fn"}
    )
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        get_predefined_dispatch_fn("no_such_mode")
    with pytest.raises(ValueError, match="built in"):
        Dispatch.remove("ONE_TO_ALL")


def pad_to_world(wg: Any, rows: list[int]) -> Dispatched:
    """A custom mode that pads: each rank gets an equal slice; the pad is reported."""
    n = wg.world_size
    pad = -len(rows) % n
    padded = rows + rows[:pad]
    size = len(padded) // n
    return Dispatched(([padded[i * size : (i + 1) * size] for i in range(n)],), {}, pad=pad)


def test_a_custom_dispatch_fn_returns_its_pad_and_the_rows_are_removed() -> None:
    class W(Worker):
        @register(
            dispatch_mode={
                "dispatch_fn": pad_to_world,
                "collect_fn": lambda wg, outs: DataProto.concat(outs),
            }
        )
        def rows(self, rows: list[int]) -> DataProto:
            return DataProto.from_dict({"x": torch.tensor(rows)})

    with WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(W), backend="inline"
    ) as wg:
        assert wg.rows([1, 2, 3]).batch["x"].tolist() == [1, 2, 3]
    args, kwargs = pad_to_world(type("G", (), {"world_size": 2})(), [1, 2, 3])  # unpacks as a pair
    assert args == ([[1, 2], [3, 1]],) and kwargs == {}


@dataclass
class Rows:
    """A third-party batch type: a list of row ids (as a handle to data held elsewhere)."""

    ids: list[int]
    auto_padding: bool = False

    def __len__(self) -> int:
        return len(self.ids)


register_batch_type(
    Rows,
    length=len,
    chunk=lambda b, n: [Rows(b.ids[i * (len(b) // n) : (i + 1) * (len(b) // n)]) for i in range(n)],
    concat=lambda parts: Rows([i for p in parts for i in p.ids]),
    pad=lambda b, d: Rows(b.ids + b.ids[: -len(b) % d], b.auto_padding),
    unpad=lambda b, rows: Rows(b.ids[: len(b) - rows]),
)


@dataclass
class FixedRows:
    ids: list[int]
    auto_padding: bool = True


register_batch_type(
    FixedRows,
    length=lambda b: len(b.ids),
    chunk=lambda b, n: [FixedRows(b.ids[i::n]) for i in range(n)],
    concat=lambda parts: FixedRows([i for p in parts for i in p.ids]),
)


class RowsWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def tag(self, batch: Rows) -> Rows:
        return Rows([i * 10 + self.rank for i in batch.ids])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def tag_later(self, batch: Rows) -> Rows:
        return Rows([i * 10 + self.rank for i in batch.ids])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def fixed(self, batch: FixedRows) -> FixedRows:
        return batch


def test_a_registered_batch_type_is_split_padded_and_joined() -> None:
    with WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(RowsWorker), backend="inline"
    ) as wg:
        assert wg.tag(Rows([1, 2, 3, 4])) == Rows([10, 20, 31, 41])
        assert wg.tag_later(Rows([1, 2])).get() == Rows([10, 21])
        assert wg.tag(Rows([1, 2, 3], auto_padding=True)) == Rows([10, 20, 31])
        with pytest.raises(DispatchError, match="does not divide"):
            wg.tag(Rows([1, 2, 3]))
        with pytest.raises(DispatchError, match="FixedRows cannot be padded"):
            wg.fixed(FixedRows([1, 2, 3]))


def test_register_batch_type_refuses_half_a_padding_pair() -> None:
    with pytest.raises(ValueError, match="both pad= and unpad="):
        register_batch_type(
            Rows, length=len, chunk=lambda b, n: [b], concat=list, pad=lambda b, d: b
        )
