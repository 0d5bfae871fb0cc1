"""Conformance: every dispatch mode, padding, custom modes, nd-mesh dispatch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from podium import (
    DataProto,
    DataProtoFuture,
    Dispatch,
    DispatchError,
    WorkerGroup,
    get,
    register_dispatch_mode,
    update_dispatch_mode,
)
from podium.core import dispatch as builtin
from podium.testing.conformance.base import WORLD, BackendFixtures
from podium.testing.conformance.workers import MESH


def batch(n: int, *, auto_padding: bool = False) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n, dtype=torch.float32)},
        {"uid": [f"u{i}" for i in range(n)]},
        meta_info={"step": 1},
        auto_padding=auto_padding,
    )


class DispatchTests(BackendFixtures):
    def test_one_to_all_sends_the_same_arguments_to_every_rank(self, wg: WorkerGroup) -> None:
        out = wg.whoami("t")
        assert [o["rank"] for o in out] == list(range(WORLD))
        assert all(o["tag"] == "t" and o["offset"] == 5 for o in out)

    def test_all_to_all_slices_lists_of_world_size_per_rank(self, wg: WorkerGroup) -> None:
        out = wg.echo([10, 11, 12, 13], key=["a", "b", "c", "d"])
        assert out == [(r, (10 + r,), {"key": "abcd"[r]}) for r in range(WORLD)]
        whole = wg.echo([1, 2], 3)
        assert all(args == ([1, 2], 3) for _, args, _ in whole)

    def test_rank_zero_dispatch_returns_rank_zeros_value(self, wg: WorkerGroup) -> None:
        assert wg.rank_zero_echo("v") == (0, "v")

    def test_execute_rank_zero_runs_only_rank_zero(self, wg: WorkerGroup) -> None:
        before = wg.count()
        assert wg.only_rank_zero("v") == (0, "v")
        assert wg.execute_rank_zero_sync("count") == before[0] + 1
        after = wg.count()
        assert after[0] == before[0] + 2 and after[1:] == [b + 1 for b in before[1:]]

    def test_dp_compute_gives_rank_i_element_i(self, wg: WorkerGroup) -> None:
        assert wg.dp_compute([1, 2, 3, 4], scale=[10] * WORLD) == [(r, (r + 1) * 10) for r in range(WORLD)]

    def test_dp_compute_rejects_wrong_lengths(self, wg: WorkerGroup) -> None:
        with pytest.raises(DispatchError, match="length 4"):
            wg.dp_compute([1, 2, 3])

    def test_dp_compute_proto_splits_and_gathers_in_order(self, wg: WorkerGroup) -> None:
        data = batch(8)
        out = wg.add_rank(data)
        assert isinstance(out, DataProto) and len(out) == 8
        assert out.batch["x"].tolist() == [float(i + i // 2) for i in range(8)]
        assert out.batch["rank"].tolist() == [i // 2 for i in range(8)]
        assert out.meta_info["metrics"] == {"rank": list(range(WORLD)), "rows": [2] * WORLD}

    def test_dp_compute_proto_broadcasts_plain_args_and_splits_kwargs(self, wg: WorkerGroup) -> None:
        out = wg.add_rank(data=batch(4), bias=0.5)
        assert out.batch["x"].tolist() == [i + i + 0.5 for i in range(4)]

    def test_dispatch_never_mutates_the_callers_object(self, wg: WorkerGroup) -> None:
        data = batch(6, auto_padding=True)
        before_x = data.batch["x"].clone()
        wg.add_rank(data)
        assert len(data) == 6
        assert torch.equal(data.batch["x"], before_x)
        assert data.meta_info == {"step": 1}
        assert list(data.non_tensor_batch["uid"]) == [f"u{i}" for i in range(6)]

    def test_in_place_operations_in_a_worker_leave_the_callers_object(self, wg: WorkerGroup) -> None:
        data = batch(8)
        out = wg.change_in_place(data)
        assert set(out.batch.keys()) == {"z", "w"}
        assert out.batch["w"].tolist() == [float(i // 2) for i in range(8)]
        assert data.batch is not None and set(data.batch.keys()) == {"x"}
        assert data.batch["x"].tolist() == list(range(8))

    def test_plain_tensordict_in_tensordict_out(self, wg: WorkerGroup) -> None:
        td = TensorDict({"x": torch.zeros(8)}, batch_size=[8])
        out = wg.add_rank_td(td)
        assert isinstance(out, TensorDict)
        assert out["x"].tolist() == [float(i // 2) for i in range(8)]

    def test_non_divisible_batch_without_padding_is_a_dispatch_error(self, wg: WorkerGroup) -> None:
        with pytest.raises(DispatchError) as info:
            wg.add_rank(batch(6))
        text = str(info.value)
        assert "6" in text and "4" in text and "auto_padding" in text

    def test_auto_padding_removes_padded_rows_from_the_result(self, wg: WorkerGroup) -> None:
        out = wg.add_rank(batch(10, auto_padding=True))
        assert len(out) == 10
        # 10 rows padded to 12 -> 3 per rank; rows 0..9 keep their own rank's offset.
        assert out.batch["x"].tolist() == [float(i + i // 3) for i in range(10)]
        assert list(out.non_tensor_batch.get("uid", [])) in ([], [f"u{i}" for i in range(10)])

    def test_nonblocking_dp_result_has_no_padded_rows(self, wg: WorkerGroup) -> None:
        fut = wg.add_rank_async(batch(6, auto_padding=True))
        assert isinstance(fut, DataProtoFuture)
        out = fut.get()
        assert len(out) == 6
        assert out.batch["x"].tolist() == [float(i + i // 2) for i in range(6)]
        assert len(get(fut)) == 6

    def test_future_that_needs_padding_feeds_another_groups_dp_call(
        self, wg: WorkerGroup, pair_wg: WorkerGroup
    ) -> None:
        # pair_wg (world 2) makes 6 rows; wg (world 4) pads them to 8 for its call
        # (2 rows per rank) and must give back exactly the 6 rows, in order.
        expected = [float(i + i // 3 + i // 2) for i in range(6)]
        out = wg.add_rank(pair_wg.add_rank_async(batch(6, auto_padding=True)))
        assert len(out) == 6
        assert out.batch["x"].tolist() == expected
        assert out.batch["rank"].tolist() == [i // 2 for i in range(6)]
        fut = wg.add_rank_async(pair_wg.add_rank_async(batch(6, auto_padding=True)))
        assert isinstance(fut, DataProtoFuture)
        assert fut.get().batch["x"].tolist() == expected
        # The unresolved result of the padded call feeds a third call: still 6 rows.
        again = pair_wg.add_rank(fut)
        assert again.batch["x"].tolist() == [x + i // 3 for i, x in enumerate(expected)]

    def test_dp_compute_metric_splits_a_future_unevenly_without_padding(
        self, wg: WorkerGroup, pair_wg: WorkerGroup
    ) -> None:
        out = wg.metric(pair_wg.add_rank_async(batch(6, auto_padding=True)))
        assert [m["rows"] for m in out] == [2, 2, 1, 1]
        assert sum(m["sum"] for m in out) == float(sum(i + i // 3 for i in range(6)))

    def test_future_that_does_not_divide_without_auto_padding_fails_clearly(
        self, wg: WorkerGroup, pair_wg: WorkerGroup
    ) -> None:
        fut = pair_wg.add_rank_async(batch(6))
        with pytest.raises(DispatchError) as info:
            wg.add_rank(fut)
        text = str(info.value)
        assert "6" in text and "4" in text and "auto_padding" in text
        assert len(wg.add_rank(batch(4))) == 4  # the group stays usable

    def test_dp_compute_metric_keeps_every_ranks_result(self, wg: WorkerGroup) -> None:
        out = wg.metric(batch(6, auto_padding=True))
        assert [m["rank"] for m in out] == list(range(WORLD))
        assert [m["rows"] for m in out] == [2, 2, 1, 1]
        assert sum(m["sum"] for m in out) == float(sum(range(6)))
        exact = wg.metric(batch(8))
        assert [m["rows"] for m in exact] == [2] * WORLD

    def test_dp_compute_proto_with_func_sends_the_function_whole(self, wg: WorkerGroup) -> None:
        def double_plus_rank(worker: Any, data: DataProto) -> DataProto:
            out = data.select(batch_keys=["x"], deepcopy=True)
            out.batch["x"] = out.batch["x"] * 2 + worker.rank
            return out

        out = wg.execute_with_func_generator(double_plus_rank, batch(4))
        assert out.batch["x"].tolist() == [0.0, 3.0, 6.0, 9.0]

    def test_execute_func_rank_zero(self, wg: WorkerGroup) -> None:
        assert wg.execute_func_rank_zero(lambda a, b: a * b, 6, b=7) == 42

    def test_custom_dispatch_modes(self, wg: WorkerGroup) -> None:
        def first_two(worker_group: Any, *args: Any, **kwargs: Any) -> Any:
            return tuple([a] * worker_group.world_size for a in args), kwargs

        def take_two(worker_group: Any, outputs: list[Any]) -> Any:
            return outputs[:2]

        name = f"suite_first_two_{id(wg)}"
        register_dispatch_mode(name, first_two, take_two)
        with pytest.raises(ValueError, match="already registered"):
            register_dispatch_mode(name, first_two, take_two)
        from podium import register

        class Custom:
            @register(dispatch_mode=name)
            def m(self) -> None: ...

            @register(dispatch_mode={"dispatch_fn": first_two, "collect_fn": take_two})
            def n(self) -> None: ...

        # The dispatch functions run at the controller: check them on this group.
        from podium.core.decorator import resolve_dispatch_mode

        mode = resolve_dispatch_mode(name)
        args, _ = mode.dispatch_fn(wg, "x")
        assert args == (["x"] * WORLD,)
        update_dispatch_mode(Dispatch.ONE_TO_ALL, first_two, take_two)
        try:
            assert [o["rank"] for o in wg.whoami()] == [0, 1]
        finally:
            update_dispatch_mode(Dispatch.ONE_TO_ALL, builtin.dispatch_one_to_all, builtin.collect_all_to_all)
        assert len(wg.whoami()) == WORLD

    def test_nd_mesh_sends_one_shard_per_dp_rank_and_collects_from_collect_ranks(self, mesh_wg: WorkerGroup) -> None:
        out = mesh_wg.shard(batch(4))
        # dp_size 2: rows 0-1 -> dp 0 (ranks 0,1), rows 2-3 -> dp 1 (ranks 2,3); tp 0 collects.
        assert out.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert out.batch["dp"].tolist() == [0, 0, 1, 1]
        assert out.batch["tp"].tolist() == [0, 0, 0, 0]

    def test_the_controller_reads_each_ranks_place_in_a_mesh(self, mesh_wg: WorkerGroup) -> None:
        assert mesh_wg._query_dispatch_info(MESH) == [0, 0, 1, 1]
        assert mesh_wg._query_collect_info(MESH) == [True, False, True, False]
        with pytest.raises(ValueError, match="not registered"):
            mesh_wg._query_dispatch_info("no_such_mesh")

    def test_nd_mesh_accepts_data_by_keyword_and_pads(self, mesh_wg: WorkerGroup) -> None:
        out = mesh_wg.shard(data=batch(3, auto_padding=True))
        assert out.batch["x"].tolist() == [0.0, 1.0, 2.0]
        assert out.batch["dp"].tolist() == [0, 0, 1]

    def test_nd_mesh_nonblocking(self, mesh_wg: WorkerGroup) -> None:
        fut = mesh_wg.shard_async(batch(5, auto_padding=True))
        out = get(fut)
        assert out.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert out.batch["dp"].tolist() == [0, 0, 0, 1, 1]
