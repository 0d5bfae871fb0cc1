"""Known single-controller bugs podium must not have (each fails on the buggy behaviour)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from podium import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    get,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)


class Rows(Worker):
    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("m", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_async(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def rows(self, data: DataProto) -> int:
        return len(data)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def hello(self, name: str) -> str:
        return f"hello {name} from {self.rank}"

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("m"))
    def mesh_echo(self, data: DataProto) -> DataProto:
        return data


@pytest.fixture(scope="module")
def wg() -> Iterator[WorkerGroup]:
    with WorkerGroup(ResourcePool([4], use_gpu=False), ClassWithInitArgs(Rows), backend="inline") as group:
        yield group


def data(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n)}, meta_info={"k": "v"}, auto_padding=True)


def test_nonblocking_call_result_has_no_padded_rows(wg: WorkerGroup) -> None:
    out = get(wg.echo_async(data(5)))
    assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]


def test_dp_compute_metric_keeps_every_rank_and_drops_no_result(wg: WorkerGroup) -> None:
    assert wg.rows(data(5)) == [2, 1, 1, 1]  # 4 results, 5 real rows, no padded row counted


def test_chunks_do_not_share_meta_info() -> None:
    chunks = data(4).chunk(2)
    chunks[0].meta_info["k"] = "changed"
    assert chunks[1].meta_info["k"] == "v"


def test_dispatch_rank_zero_is_a_real_mode(wg: WorkerGroup) -> None:
    assert wg.hello("podium") == "hello podium from 0"


def test_nd_mesh_dispatch_accepts_keyword_data(wg: WorkerGroup) -> None:
    out = wg.mesh_echo(data=data(4))
    assert out.batch["x"].tolist() == [0, 1, 2, 3]


def test_padding_does_not_touch_the_callers_batch(wg: WorkerGroup) -> None:
    d = data(5)
    get(wg.echo_async(d))
    wg.mesh_echo(d)
    assert len(d) == 5 and d.batch["x"].tolist() == [0, 1, 2, 3, 4] and d.meta_info == {"k": "v"}


def test_a_shut_down_group_says_so() -> None:
    group = WorkerGroup(ResourcePool([1], use_gpu=False), ClassWithInitArgs(Rows), backend="inline")
    group.shutdown()
    group.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="was shut down"):
        group.hello("x")
