"""``BatchRef`` on the inline backend: metadata operations, validation, the fallback path.

The data-plane behaviour every backend must have (chains, rows per rank,
release, lost producers) is in the conformance suite; this module checks the
core's own logic without processes.
"""

from __future__ import annotations

import gc
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from podium import (
    BatchRef,
    Capabilities,
    ClassWithInitArgs,
    DataLostError,
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    get,
    register,
)
from podium.backends.inline import InlineBackend
from podium.core.dataplane import held_shards


class Producer(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO, output="ref", row_meta=["score"])
    def make(self, data: DataProto) -> DataProto:
        out = data.select()
        out.batch["score"] = data.batch["x"] * 10
        out.batch["rank"] = torch.full((len(data),), self.rank)
        return out

    @register(Dispatch.DP_COMPUTE_PROTO)
    def make_value(self, data: DataProto) -> DataProto:
        return self.make(data)

    @register(Dispatch.DP_COMPUTE_PROTO, output="ref")
    def make_td(self, td: TensorDict) -> TensorDict:
        return TensorDict({"v": td["x"] + 1}, batch_size=td.batch_size)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def passthrough(self, data: Any) -> Any:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def passthrough_async(self, data: Any) -> Any:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, output="ref")
    def not_a_batch(self, data: DataProto) -> int:
        return 3


def rows(n: int) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n, dtype=torch.float32), "m": torch.arange(2 * n).reshape(n, 2)},
        {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta_info={"k": 1},
        auto_padding=True,
    )


@pytest.fixture(scope="module")
def producer() -> Iterator[WorkerGroup]:
    with WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(Producer), backend="inline"
    ) as wg:
        yield wg


@pytest.fixture(scope="module")
def ref(producer: WorkerGroup) -> BatchRef:
    return producer.make(rows(6))


def same(a: DataProto, b: DataProto) -> None:
    assert a.batch is not None and b.batch is not None
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for k in b.batch.keys():
        assert torch.equal(a.batch[k], b.batch[k]), k
    assert {k: list(v) for k, v in a.non_tensor_batch.items()} == {
        k: list(v) for k, v in b.non_tensor_batch.items()
    }


def test_metadata_operations_match_dataproto(ref: BatchRef) -> None:
    full = ref.materialize()
    assert isinstance(full, DataProto) and len(ref) == 6
    assert ref.keys() == ["x", "m", "score", "rank", "uid"]
    assert ref.row_meta["score"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    same(ref.select(["m"], []).materialize(), full.select(["m"], []))
    same(ref[1:4].materialize(), full[1:4])
    same(ref[[5, 0, 3]].materialize(), full[[5, 0, 3]])
    mask = np.array([True, False] * 3)
    same(ref[mask].materialize(), full[mask])
    assert ref[[5, 0]].row_meta["score"].tolist() == [50.0, 0.0]
    same(BatchRef.concat(ref.chunk(3)[::-1]).materialize(), DataProto.concat(full.chunk(3)[::-1]))
    same(ref.repeat(2).materialize(), full.repeat(2))
    padded, pad = ref[:5].pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    same(padded.materialize(), full[[0, 1, 2, 3, 4, 0, 1, 2]])
    moved = ref[:]
    moved.reorder([2, 1, 0, 3, 4, 5])
    same(moved.materialize(), full[[2, 1, 0, 3, 4, 5]])
    both = ref.select(["x"], ["uid"]).union(ref[:].select(["score"], []))
    same(both.materialize(), full.select(["x", "score"], ["uid"]))
    with pytest.raises(ValueError, match="equal chunks"):
        ref.chunk(4)
    with pytest.raises(KeyError, match="nope"):
        ref.select(["nope"])
    with pytest.raises(ValueError, match="different rows"):
        ref.select(["x"]).union(ref[::-1].select(["x"]))


def test_scattered_rows_from_several_shards_keep_their_order(ref: BatchRef) -> None:
    order = [5, 0, 4, 1, 3, 2]
    same(ref[order].materialize(), ref.materialize()[order])
    assert get(ref[order]).batch["rank"].tolist() == [1, 0, 1, 0, 1, 0]


def test_a_worker_receives_a_dataproto_and_the_controller_only_metadata(
    producer: WorkerGroup, ref: BatchRef
) -> None:
    out = producer.passthrough(ref.select(["score"], []))
    assert isinstance(out, DataProto) and out.batch is not None
    assert sorted(out.batch.keys()) == ["score"]
    assert out.batch["score"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    # The reference itself is small: row ranges and the metadata, not the rows.
    big = producer.make(rows(4096))
    published = sum(v.nbytes for v in big.row_meta.values())
    assert len(pickle.dumps(big)) < 2048 + published
    copy = pickle.loads(pickle.dumps(big[[3, 2, 1]]))
    assert copy.materialize().batch["x"].tolist() == [3.0, 2.0, 1.0]
    big.release()


def test_pickled_copies_read_the_rows_but_keep_nothing_alive(producer: WorkerGroup) -> None:
    before = held_shards()["shards"]
    ref = producer.make(rows(4))
    copy = pickle.loads(pickle.dumps(ref))
    same(copy.materialize(), ref.materialize())
    del ref
    producer.passthrough(rows(2))  # frees with the next call
    assert held_shards()["shards"] == before
    with pytest.raises(DataLostError):
        copy.materialize()


def test_a_pending_call_keeps_its_batch_ref_arguments_alive(producer: WorkerGroup) -> None:
    before = held_shards()["shards"]
    ref = producer.make(rows(4))
    future = producer.passthrough_async(ref.select(["x"], []))
    del ref
    gc.collect()
    producer.passthrough(rows(2))  # releases of dropped references go out with a call
    assert held_shards()["shards"] == before + 2  # the pending call still names them
    assert get(future).batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    del future
    gc.collect()
    producer.passthrough(rows(2))
    assert held_shards()["shards"] == before


def test_tensordict_outputs_stay_tensordicts(producer: WorkerGroup) -> None:
    td = TensorDict({"x": torch.arange(4.0)}, batch_size=[4])
    ref = producer.make_td(td)
    got = ref.materialize()
    assert isinstance(got, TensorDict) and got["v"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_register_validates_output_options() -> None:
    with pytest.raises(ValueError, match="'value' or 'ref'"):
        register(Dispatch.DP_COMPUTE_PROTO, output="refs")
    with pytest.raises(ValueError, match="only with output='ref'"):
        register(Dispatch.DP_COMPUTE_PROTO, row_meta=["a"])
    with pytest.raises(ValueError, match="blocking=True"):
        register(Dispatch.DP_COMPUTE_PROTO, output="ref", blocking=False)


def test_a_ref_method_returning_no_batch_fails_with_the_fix(producer: WorkerGroup) -> None:
    with pytest.raises(TypeError, match="must return a DataProto or a TensorDict"):
        producer.not_a_batch(rows(2))


class NoRefsBackend(InlineBackend):
    """The inline backend without ``batch_refs``: as a plugin that does not implement the data plane."""

    name = "inline-norefs"
    capabilities = Capabilities(fractional_colocation=True)


def test_backend_without_batch_refs_falls_back_to_the_controller_with_equal_results() -> None:
    backend = NoRefsBackend()
    pool = ResourcePool([2], use_gpu=False)
    with (
        WorkerGroup(pool, ClassWithInitArgs(Producer), backend=backend) as a,
        WorkerGroup(
            ResourcePool([3], use_gpu=False), ClassWithInitArgs(Producer), backend=backend
        ) as b,
    ):
        data = rows(5)
        ref = a.make(data)
        assert isinstance(ref, BatchRef) and ref.held_by_controller
        # Published as a rank would publish them: the same BatchRef on every backend.
        assert ref.row_meta["score"].tolist() == (data.batch["x"] * 10).tolist()
        same(b.make(ref).materialize(), b.make_value(a.make_value(data)))
