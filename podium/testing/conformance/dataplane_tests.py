"""Conformance: the data plane (``output="ref"``, ``BatchRef`` arguments, lifetime, lost producers)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest
import torch

from podium import (
    BatchRef,
    ClassWithInitArgs,
    DataLostError,
    DataProto,
    ResourcePool,
    WorkerDiedError,
    WorkerGroup,
    get,
)
from podium.core.backend import Backend
from podium.testing.conformance.base import BackendFixtures, skip_unless
from podium.testing.conformance.workers import ConformanceWorker


def rows(n: int) -> DataProto:
    return DataProto.from_dict(
        {
            "x": torch.arange(n, dtype=torch.float32),
            "w": torch.arange(4 * n, dtype=torch.float32).reshape(n, 4),
        },
        {"uid": [f"u{i}" for i in range(n)]},
        meta_info={"step": 1},
        auto_padding=True,
    )


def assert_same(got: DataProto, want: DataProto) -> None:
    assert got.batch is not None and want.batch is not None
    assert sorted(got.batch.keys()) == sorted(want.batch.keys())
    for key in want.batch.keys():
        assert torch.equal(got.batch[key], want.batch[key]), key
    assert sorted(got.non_tensor_batch) == sorted(want.non_tensor_batch)
    for key, value in want.non_tensor_batch.items():
        assert list(got.non_tensor_batch[key]) == list(value), key
    assert got.meta_info == want.meta_info


class DataPlaneTests(BackendFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def trio_wg(cls, backend: Backend) -> Iterator[WorkerGroup]:
        """A group of 3: batches of a 2-rank group split unevenly over it."""
        group = cls._group(
            backend, ResourcePool([3], use_gpu=False), ClassWithInitArgs(ConformanceWorker)
        )
        yield group
        group.shutdown()

    def test_batch_ref_chain_equals_dataproto_calls(
        self, pair_wg: WorkerGroup, trio_wg: WorkerGroup
    ) -> None:
        # 7 rows: A(2) pads to 8, B(3) pads to 9, C(2) pads to 8 -- in the index, never in the output.
        data = rows(7)
        a = pair_wg.ref_stage(data, scale=2.0)
        b = trio_wg.ref_stage(a, scale=3.0)
        c = pair_wg.ref_stage(b, scale=5.0)
        assert all(isinstance(r, BatchRef) and len(r) == 7 for r in (a, b, c))
        want = pair_wg.value_stage(
            trio_wg.value_stage(pair_wg.value_stage(data, scale=2.0), scale=3.0), scale=5.0
        )
        got = c.materialize()
        assert_same(got, want)
        assert_same(get(b), trio_wg.value_stage(pair_wg.value_stage(data, scale=2.0), scale=3.0))
        assert c.row_meta["length"].tolist() == want.batch["length"].tolist()
        assert c.meta_info == want.meta_info
        assert list(got.non_tensor_batch["uid"]) == [f"u{i}" for i in range(7)]  # no padded row
        # A DataProto call on a BatchRef gives the plain call's result too.
        assert_same(trio_wg.value_stage(a, scale=3.0), trio_wg.value_stage(get(a), scale=3.0))

    def test_a_chain_of_page_sized_rows_step_after_step(
        self, pair_wg: WorkerGroup, trio_wg: WorkerGroup
    ) -> None:
        # 4 KiB rows, enough of them that a consumer's rows span two producers' shards;
        # each consumer writes into its input, which must stay its own.
        n = 301
        data = DataProto.from_dict(
            {
                "x": torch.arange(n, dtype=torch.float32),
                "w": torch.arange(n * 1024, dtype=torch.float32).reshape(n, 1024),
            },
            {"uid": [f"u{i}" for i in range(n)]},
            auto_padding=True,
        )
        for step in range(2):  # the second step reuses what the first one left
            a = pair_wg.ref_stage(data, scale=2.0)
            b = trio_wg.bump_ref(a, by=1.0)
            c = pair_wg.bump_ref(b, by=10.0)
            got = c.materialize()
            assert torch.equal(got.batch["w"], data.batch["w"] + 11.0), step
            assert list(got.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
            # The producers' rows are untouched by what their readers wrote.
            assert torch.equal(get(a).batch["w"], data.batch["w"]), step
            assert torch.equal(get(b).batch["w"], data.batch["w"] + 1.0), step
            for ref in (a, b, c):
                ref.release()

    def test_consumer_receives_only_its_rows_and_keys(
        self, backend: Backend, pair_wg: WorkerGroup, trio_wg: WorkerGroup
    ) -> None:
        ref = pair_wg.ref_stage(rows(6))
        trio_wg.dataplane_stats(reset=True)
        out = trio_wg.received(ref.select(["y"], ["uid"]))
        stats = trio_wg.dataplane_stats()
        assert [o["type"] for o in out] == ["DataProto"] * 3
        assert [o["keys"] for o in out] == [["y", "uid"]] * 3  # tensor keys, then non-tensor keys
        assert [o["uid"] for o in out] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
        share = 2 * 4  # 2 rows of one float32 key
        if not backend.capabilities.batch_refs:  # the rows came through the controller, by value
            return
        if backend.capabilities.process_group:  # one process per rank: its own counters
            assert [s["fetched_bytes"] for s in stats] == [share] * 3
        else:  # every rank in one process: one counter for all
            assert stats[0]["fetched_bytes"] == 3 * share

    def test_nd_mesh_replicas_read_one_share_each(
        self, backend: Backend, pair_wg: WorkerGroup, mesh_wg: WorkerGroup
    ) -> None:
        ref = pair_wg.ref_stage(rows(8)).select(["x"], [])
        before = mesh_wg.mesh_stats(reset=True)
        out = mesh_wg.shard_ref(ref)
        stats = mesh_wg.mesh_stats()
        assert isinstance(out, BatchRef) and len(out) == 8
        assert out.producer_ranks == [
            0,
            2,
        ]  # only the collect rank of each replica keeps its output
        got = out.materialize()
        assert got.batch["x"].tolist() == [float(i) for i in range(8)]
        assert got.batch["dp"].tolist() == [0] * 4 + [1] * 4
        if backend.capabilities.process_group and backend.capabilities.batch_refs:
            assert [s["shards"] - b["shards"] for s, b in zip(stats, before)] == [1, 0, 1, 0]
            # Each rank read its replica's half (4 rows x 4 bytes), never the whole batch.
            assert [s["fetched_bytes"] for s in stats] == [16] * 4
        out.release()

    def test_release_frees_producer_memory(self, backend: Backend, pair_wg: WorkerGroup) -> None:
        skip_unless(backend, "batch_refs")  # without it the controller holds the rows
        before = pair_wg.dataplane_stats()
        ref = pair_wg.ref_stage(rows(64))
        held = pair_wg.dataplane_stats()
        per_rank = backend.capabilities.process_group
        grew = [h["shards"] - b["shards"] for h, b in zip(held, before)]
        assert grew == ([1, 1] if per_rank else [2, 2])
        assert all(h["bytes"] > b["bytes"] for h, b in zip(held, before))
        part = ref[:3]  # shares the shards
        ref.release()
        assert [(s["shards"], s["bytes"]) for s in pair_wg.dataplane_stats()] == [
            (b["shards"], b["bytes"]) for b in before
        ]
        with pytest.raises(ValueError, match="released"):
            part.materialize()
        # Dropped without release(): freed with the group's next call.
        dropped = pair_wg.ref_stage(rows(64))
        del dropped
        gc.collect()
        assert [s["shards"] for s in pair_wg.dataplane_stats()] == [b["shards"] for b in before]

    def test_killed_producer_is_data_lost(self, backend: Backend, trio_wg: WorkerGroup) -> None:
        skip_unless(backend, "detects_dead_workers")
        skip_unless(backend, "batch_refs")  # without it the rows outlive their producer
        doomed = self._group(
            backend, ResourcePool([1], use_gpu=False), ClassWithInitArgs(ConformanceWorker)
        )
        try:
            ref = doomed.ref_stage(rows(3))
            with pytest.raises(WorkerDiedError):
                doomed.die(0)
            start = time.monotonic()
            with pytest.raises(DataLostError):
                trio_wg.received(ref)
            with pytest.raises(DataLostError):
                ref.materialize()
            assert time.monotonic() - start < 15
        finally:
            doomed.shutdown()
        assert len(trio_wg.received(rows(3))) == 3  # the consumer group is unharmed

    def test_colocated_role_reads_without_copy(
        self, backend: Backend, colocated: dict[str, WorkerGroup]
    ) -> None:
        ref = colocated["actor"].score_ref(rows(4))
        out = colocated["critic"].shares_memory(ref.select(["x"], []))
        assert [o["x"] for o in out] == [[0.0, 2.0], [4.0, 6.0]]
        if backend.capabilities.batch_refs:  # otherwise a copy came through the controller
            assert all(o["same"] for o in out)
