"""The Ray data plane: a shard is one copy in the object store; a consumer copies its rows once."""

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch
from _raytools import restart_ray, stop_ray

from podium import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)
from podium.backends.ray.dataplane import columns_of, read_columns
from podium.core.dataplane import plan

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def no_other_ray() -> Iterator[None]:
    restart_ray(num_cpus=8)  # podium's groups join this Ray
    yield
    stop_ray()


def batch(n: int, offset: int = 0) -> DataProto:
    ids = torch.arange(offset, offset + n)
    return DataProto.from_dict(
        {
            "x": ids.to(torch.float32)[:, None].expand(-1, 3).clone(),
            "h": ids.to(torch.bfloat16),  # no numpy dtype: travels as bytes
            "k": ids.to(torch.int64),
        },
        {"uid": [f"u{i}" for i in ids.tolist()]},
        meta_info={"step": 3},
        auto_padding=True,
    )


def test_an_export_puts_the_tensors_own_memory_and_reads_copy_only_the_rows() -> None:
    data = batch(6)
    layout, _ = plan(data)
    columns = columns_of(data, layout)
    # The object is built from views of the tensors: ray.put's copy is the only one.
    for col, arr in zip(layout.columns, columns):
        assert arr.ctypes.data == data.batch[col.key].data_ptr()
    stored = ray.get(ray.put(columns))
    assert not stored[0].flags.writeable  # object-store pages

    rows = np.arange(2, 5)
    got = read_columns(layout, stored, rows, ["x", "h", "k"], ["uid"], {"step": 3}, copy=True)
    assert isinstance(got, DataProto)
    for key in ("x", "h", "k"):
        assert torch.equal(got.batch[key], data.batch[key][2:5]), key
    assert list(got.non_tensor_batch["uid"]) == ["u2", "u3", "u4"]
    assert got.meta_info == {"step": 3}
    # The copy is ordinary writable memory, apart from the store.
    got.batch["x"] += 1
    again = read_columns(layout, stored, rows, ["x"], [], {}, copy=True)
    assert torch.equal(again.batch["x"], data.batch["x"][2:5])

    # copy=False (rows that are joined next): views of the store, no copy of their own.
    view = read_columns(layout, stored, rows, ["x"], [], {}, copy=False)
    start = stored[0].ctypes.data
    assert view.batch["x"].data_ptr() == start + 2 * layout.column("x").row_bytes
    # Scattered rows are gathered (a copy) either way.
    scattered = read_columns(layout, stored, np.array([4, 0, 4]), ["k"], [], {}, copy=False)
    assert scattered.batch["k"].tolist() == [4, 0, 4]


class Stage(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, output="ref")
    def make(self, seed: DataProto) -> DataProto:
        ids = seed.batch["i"]
        return batch(len(ids), int(ids[0]))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def look(self, data: DataProto) -> dict[str, Any]:
        """This rank's rows, and whether they are writable memory of its own."""
        x = data.batch["x"]
        before = x.clone()
        x += 1  # a user may write to what it was handed
        return {
            "k": data.batch["k"].tolist(),
            "h": data.batch["h"].float().tolist(),
            "uid": list(data.non_tensor_batch["uid"]),
            "wrote": torch.equal(x, before + 1),
        }


def test_consumer_rows_across_producers_are_one_writable_batch_in_order() -> None:
    pool = lambda n: ResourcePool([n], use_gpu=False)  # noqa: E731
    with (
        WorkerGroup(pool(2), ClassWithInitArgs(Stage), backend="ray") as producers,
        WorkerGroup(pool(3), ClassWithInitArgs(Stage), backend="ray") as consumers,
    ):
        # 10 rows on 2 producers (5 each) split 4/3/3 over 3 consumers: rank 1 reads
        # row 4 of the first shard and rows 0-1 of the second.
        seed = DataProto.from_dict({"i": torch.arange(10)}, auto_padding=True)
        ref = producers.make(seed)
        out = consumers.look(ref)
        assert [o["k"] for o in out] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
        assert [o["h"] for o in out] == [[float(k) for k in o["k"]] for o in out]
        assert [o["uid"] for o in out] == [[f"u{k}" for k in o["k"]] for o in out]
        assert all(o["wrote"] for o in out)
        # The writes stayed in the consumers: the shards still hold the original rows.
        assert torch.equal(ref.materialize().batch["x"], batch(10).batch["x"])
        assert torch.equal(ref[3:7].materialize().batch["k"], torch.arange(3, 7))
        ref.release(wait=True)


# -- results a collect joins ------------------------------------------------------

COLS = 2048  # a rank's 256 rows of float32: 2 MiB, above wire.SHARED_MIN


class Results(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] * 2})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def with_metrics(self, data: DataProto) -> DataProto:
        y = data.batch["x"] * 2
        # The same tensor in the batch and in meta_info, which the collect passes on.
        return DataProto.from_dict({"y": y}, meta_info={"metrics": {"y": y}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def big(self) -> torch.Tensor:
        return torch.ones(256, COLS)


def in_object_store(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in Ray's object store (its shared mapping in this process)."""
    address = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return len(fields) > 5 and "plasma" in fields[5]
    return False


def test_a_collect_copies_large_results_once_and_hands_out_private_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import podium.core.protocol as protocol

    joined: list[list[bool]] = []

    def record(parts: list[torch.Tensor]) -> None:
        joined.append([in_object_store(p) for p in parts])
        return None  # cat_rows joins them as usual

    monkeypatch.setattr(protocol, "_row_joiners", [record])
    x = torch.arange(512 * COLS, dtype=torch.float32).reshape(512, COLS)
    with WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(Results), backend="ray") as wg:
        out = wg.double(DataProto.from_dict({"x": x}))
        # The ranks' results reached the join in the object store: its copy was the only one.
        assert joined == [[True, True]]
        assert torch.equal(out.batch["y"], x * 2)
        assert not in_object_store(out.batch["y"])
        out.batch["y"] += 1  # the user's own memory
        assert torch.equal(wg.double(DataProto.from_dict({"x": x})).batch["y"], x * 2)

        # A tensor that meta_info holds too would leave with the result: all is copied.
        joined.clear()
        out = wg.with_metrics(DataProto.from_dict({"x": x}))
        assert joined == [[False, False]]
        parts = out.meta_info["metrics"]["y"]
        assert [torch.equal(p, x[i * 256 : (i + 1) * 256] * 2) for i, p in enumerate(parts)] == [True, True]
        assert not any(in_object_store(p) for p in parts)
        assert not in_object_store(out.batch["y"])

        # A result the user receives as it is (no join) is private memory.
        values = wg.big()
        assert [in_object_store(v) for v in values] == [False, False]
        assert all(torch.equal(v, torch.ones(256, COLS)) for v in values)


# -- what a rank receives ---------------------------------------------------------


class Inputs(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump(self, data: DataProto) -> DataProto:
        """Its rows plus one, written in place, and whether they were in the object store."""
        x = data.batch["x"]
        stored = in_object_store(x)
        x += 1
        return DataProto.from_dict({"y": x.clone(), "stored": torch.full((len(data),), stored)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def keep(self, data: DataProto) -> DataProto:
        self.kept = data.batch["x"]
        return DataProto.from_dict({"n": torch.ones(len(data))})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kept_sum(self) -> float:
        return float(self.kept.double().sum())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def bump_shared(self, t: torch.Tensor) -> tuple[float, bool]:
        stored = in_object_store(t)
        t += self.rank + 1
        return float(t[0, 0]), stored


def test_a_rank_uses_its_own_large_shard_in_place_and_copies_what_ranks_share() -> None:
    x = torch.arange(512 * COLS, dtype=torch.float32).reshape(512, COLS)
    small = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    with WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(Inputs), backend="ray") as wg:
        # A rank's own 2 MiB shard is read where the controller wrote it: no copy,
        # and writable -- no other task reads that object.
        out = wg.bump(DataProto.from_dict({"x": x}))
        assert out.batch["stored"].tolist() == [True] * 512
        assert torch.equal(out.batch["y"], x + 1)
        assert torch.equal(x, torch.arange(512 * COLS, dtype=torch.float32).reshape(512, COLS))
        # A small shard travels inline and is copied: writable all the same.
        out = wg.bump(DataProto.from_dict({"x": small}))
        assert out.batch["stored"].tolist() == [False] * 16
        assert torch.equal(out.batch["y"], small + 1)

        # One tensor for every rank: each gets a private copy, a write stays in its rank.
        assert wg.bump_shared(x) == [(1.0, False), (2.0, False)]
        assert x[0, 0].item() == 0.0

        # A shard a rank keeps past the call stays valid while later calls churn the store.
        wg.keep(DataProto.from_dict({"x": x}))
        for k in range(5):
            wg.bump(DataProto.from_dict({"x": torch.full_like(x, float(k))}))
        half = x.double()[:256].sum().item(), x.double()[256:].sum().item()
        assert wg.kept_sum() == list(half)
