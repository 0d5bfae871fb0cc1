"""verl 0.9.1's DataProto semantics, as ``podium.protocol`` provides them (in-process).

One test per behaviour a verl trainer relies on; the deliberate differences are
in docs/porting-from-verl.md.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

import podium.protocol as vp
from podium.errors import DataProtoError, DispatchError, PodiumError
from podium.protocol import (
    DataProto,
    DataProtoConfig,
    all_gather_data_proto,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
)


def rows(n: int = 6, meta: dict | None = None) -> DataProto:
    return DataProto.from_dict(
        {"obs": torch.arange(n * 2).reshape(n, 2), "idx": torch.arange(n)},
        {"label": [f"l{i}" for i in range(n)]},
        {"name": "x"} if meta is None else meta,
    )


@pytest.fixture
def no_global_padding(monkeypatch: pytest.MonkeyPatch):
    for name in ("PODIUM_AUTO_PADDING", "VERL_AUTO_PADDING"):
        monkeypatch.delenv(name, raising=False)
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = False


def test_every_public_name_resolves() -> None:
    assert all(getattr(vp, name) is not None for name in vp.__all__)


# -- errors ------------------------------------------------------------------------


def test_data_proto_error_is_value_and_assertion_error() -> None:
    for cls in (DataProtoError, DispatchError):
        assert issubclass(cls, PodiumError)
        assert issubclass(cls, ValueError) and issubclass(cls, AssertionError)
    with pytest.raises(AssertionError):  # verl code catches AssertionError
        rows(6).chunk(4)
    with pytest.raises(ValueError):
        DataProto(non_tensor_batch={"a": [1, 2], "b": [1]})


# -- construction ----------------------------------------------------------------------


def test_empty_with_none_parts_has_length_zero() -> None:
    data = DataProto(batch=None, non_tensor_batch=None, meta_info={"k": 1})  # type: ignore[arg-type]
    assert len(data) == 0 and data.non_tensor_batch == {}
    assert len(DataProto(batch=None, non_tensor_batch=None, meta_info=None)) == 0  # type: ignore[arg-type]


def test_from_dict_takes_verls_positional_order() -> None:
    data = DataProto.from_dict({"a": torch.zeros(4)}, {"b": [1, 2, 3, 4]}, {"m": 1}, 1, True)
    assert data.auto_padding is True and data.meta_info == {"m": 1}
    single = DataProto.from_single_dict({"a": torch.zeros(2)}, {"m": 2}, True)
    assert single.auto_padding is True
    with pytest.raises(AssertionError, match="exactly one batch dimension"):
        DataProto.from_dict({"a": torch.zeros(4, 3)}, num_batch_dims=2)
    with pytest.raises(AssertionError, match="fewer dims"):
        DataProto.from_dict({"a": torch.zeros(4, 3)}, num_batch_dims=3)


def test_from_tensordict_takes_verls_keywords() -> None:
    td = TensorDict({"a": torch.zeros(4, 3)}, batch_size=[4, 3])
    data = DataProto.from_tensordict(tensor_dict=td, meta_info={"m": 1}, num_batch_dims=1)
    assert data.batch is not None and data.batch.batch_size == torch.Size([4])
    assert data.meta_info == {"m": 1}
    with pytest.raises(DataProtoError, match="exactly one batch dimension"):
        DataProto.from_tensordict(tensor_dict=td, num_batch_dims=2)


# -- in place: to, rename, union ----------------------------------------------------------


def test_to_rename_union_change_the_object_and_return_it() -> None:
    data = rows(4)
    assert data.to("cpu") is data
    assert data.rename("obs", "observation") is data
    assert data.batch is not None and "observation" in data.batch.keys()
    other = DataProto.from_dict({"extra": torch.ones(4)}, meta_info={"name": "x", "k": 2})
    assert data.union(other) is data
    assert set(data.batch.keys()) == {"observation", "idx", "extra"}
    assert data.meta_info == {"name": "x", "k": 2}


def test_union_refuses_conflicts_before_changing_anything() -> None:
    data = rows(4)
    bad = DataProto.from_dict({"extra": torch.ones(4), "idx": torch.ones(4)})
    with pytest.raises(AssertionError, match="'idx' differs"):
        data.union(bad)
    assert data.batch is not None and "extra" not in data.batch.keys()


# -- select ------------------------------------------------------------------------


def test_select_skips_missing_non_tensor_and_meta_keys_like_verl() -> None:
    data = rows(4, meta={"a": 1})
    out = data.select(
        batch_keys=["obs"], non_tensor_batch_keys=["label", "nope"], meta_info_keys=["zz"]
    )
    assert list(out.non_tensor_batch) == ["label"] and out.meta_info == {}
    with pytest.raises(KeyError, match="nope"):  # batch keys must exist (TensorDict.select)
        data.select(batch_keys=["nope"])


def test_select_idxs_takes_ints_masks_and_tensors() -> None:
    data = rows(5)
    assert data.select_idxs([4, 0]).batch["idx"].tolist() == [4, 0]  # type: ignore[index]
    mask = np.array([True, False, True, False, False])
    assert data.select_idxs(mask).non_tensor_batch["label"].tolist() == ["l0", "l2"]
    assert data.select_idxs(torch.tensor([1])).batch["idx"].tolist() == [1]  # type: ignore[index]


# -- concat --------------------------------------------------------------------------


def test_concat_merges_metrics_and_refuses_conflicts() -> None:
    a = rows(2, meta={"flag": True, "metrics": [{"loss": 0.5}]})
    b = rows(2, meta={"flag": True, "extra": 1, "metrics": {"loss": 0.7}})
    c = rows(2, meta={"flag": True})
    out = DataProto.concat([c, a, b])
    assert out.meta_info == {"flag": True, "extra": 1, "metrics": {"loss": [0.5, 0.7]}}
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'flag'"):
        DataProto.concat([a, rows(2, meta={"flag": False})])


# -- chunking and padding ------------------------------------------------------------------


def test_chunk_refuses_uneven_split_even_with_padding_enabled(no_global_padding: None) -> None:
    data = rows(6)
    data.auto_padding = True
    with pytest.raises(
        DataProtoError, match="verl's chunk.*unequal size.*pad_dataproto_to_divisor"
    ):
        data.chunk(4)


def test_global_auto_padding_switch(
    no_global_padding: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = rows(4)
    assert not data.is_padding_enabled()
    DataProtoConfig.auto_padding = True
    assert data.is_padding_enabled() and not data.auto_padding
    DataProtoConfig.auto_padding = False
    for name in ("PODIUM_AUTO_PADDING", "VERL_AUTO_PADDING"):
        monkeypatch.setenv(name, "1")
        assert DataProtoConfig.auto_padding and data.is_padding_enabled()
        monkeypatch.delenv(name)
    assert not data.is_padding_enabled()
    data.meta_info[DataProtoConfig.auto_padding_key] = True  # verl's per-batch marker
    assert data.is_padding_enabled()
    with pytest.raises(DataProtoError, match="must be a bool"):
        DataProtoConfig.auto_padding = 1


def test_global_switch_pads_in_dispatch_without_touching_the_callers_object(
    no_global_padding: None,
) -> None:
    from podium import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, register

    class Adder(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def add(self, data: DataProto) -> DataProto:
            data.batch["idx"] += 100 * self.rank  # type: ignore[index]
            return data

    DataProtoConfig.auto_padding = True
    data = rows(6)
    with WorkerGroup(
        ResourcePool([4], use_gpu=False), ClassWithInitArgs(Adder), backend="inline"
    ) as wg:
        out = wg.add(data)
    assert len(out) == 6 and len(data) == 6
    assert out.batch["idx"].tolist() == [0, 1, 102, 103, 204, 205]  # rank 3 held only pad rows
    assert data.batch is not None and data.batch["idx"].tolist() == list(range(6))


def test_padding_is_in_place_and_repeats_the_last_or_first_row() -> None:
    data = rows(3)
    assert data.padding(2) is None
    assert data.batch is not None and data.batch["idx"].tolist() == [0, 1, 2, 2, 2]
    data.padding(1, padding_candidate="first")
    assert data.non_tensor_batch["label"].tolist() == ["l0", "l1", "l2", "l2", "l2", "l0"]
    data.padding(0)
    assert len(data) == 6


# -- reshaping ---------------------------------------------------------------------------


def test_sample_level_repeat() -> None:
    data = rows(3)
    out = data.sample_level_repeat([3, 0, 2])
    assert out.batch["idx"].tolist() == [0, 0, 0, 2, 2]  # type: ignore[index]
    assert data.sample_level_repeat(torch.tensor([1, 1, 1])).non_tensor_batch["label"].tolist() == [
        "l0",
        "l1",
        "l2",
    ]
    with pytest.raises(DataProtoError, match="one count per row"):
        data.sample_level_repeat([1, 2])


def test_unfold_column_chunks() -> None:
    data = DataProto.from_dict(
        {"seq": torch.arange(12).reshape(3, 4), "other": torch.arange(3)},
        {"pair": [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]], "tag": ["a", "b", "c"]},
        {"m": 1},
    )
    out = data.unfold_column_chunks(2, split_keys=["seq", "pair"])
    assert out.batch["seq"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]  # type: ignore[index]
    assert out.batch["other"].tolist() == [0, 0, 1, 1, 2, 2]  # type: ignore[index]
    assert out.non_tensor_batch["pair"].tolist() == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]
    assert out.non_tensor_batch["tag"].tolist() == ["a", "a", "b", "b", "c", "c"]
    assert out.meta_info == {"m": 1}
    with pytest.raises(DataProtoError, match="divide by n_split=3"):
        data.unfold_column_chunks(3, split_keys=["seq"])


def test_fold_and_unfold_batch_dim() -> None:
    data = rows(6)
    folded = fold_batch_dim(data, new_batch_size=3)
    assert len(folded) == 3 and folded.batch["obs"].shape == (3, 2, 2)  # type: ignore[index]
    assert folded.non_tensor_batch["label"].shape == (3, 2)
    assert data.non_tensor_batch["label"].shape == (6,)  # the input is not reshaped
    back = unfold_batch_dim(folded, batch_dims=2)
    assert back.batch["idx"].tolist() == list(range(6))  # type: ignore[index]
    assert back.non_tensor_batch["label"].tolist() == data.non_tensor_batch["label"].tolist()
    with pytest.raises(AssertionError):
        fold_batch_dim(data, new_batch_size=4)


# -- unions and serialization ----------------------------------------------------------------


def test_union_tensor_dict_and_union_numpy_dict() -> None:
    shared = torch.randn(4, 2)
    td1 = TensorDict({"a": shared}, batch_size=[4])
    assert (
        union_tensor_dict(td1, TensorDict({"a": shared, "b": torch.ones(4)}, batch_size=[4])) is td1
    )
    assert set(td1.keys()) == {"a", "b"}
    with pytest.raises(AssertionError):
        union_tensor_dict(td1, TensorDict({"a": shared + 1}, batch_size=[4]))
    nan = np.array([1.0, np.nan])
    d = {"x": nan}
    assert union_numpy_dict(d, {"x": nan.copy(), "y": np.zeros(2)}) is d and set(d) == {"x", "y"}
    with pytest.raises(
        AssertionError, match="`x` in tensor_dict1 and tensor_dict2 are not the same"
    ):
        union_numpy_dict(d, {"x": np.array([1.0, 2.0])})
    with pytest.raises(AssertionError):  # dtype differs
        union_numpy_dict({"x": np.zeros(2, dtype=np.int32)}, {"x": np.zeros(2, dtype=np.int64)})
    loop1 = np.array([None], dtype=object)
    loop1[0] = loop1
    loop2 = np.array([None], dtype=object)
    loop2[0] = loop2
    union_numpy_dict({"c": loop1}, {"c": loop2})  # cycles compare without recursing forever


def test_serialize_tensors_and_tensordicts() -> None:
    t = torch.randn(3, 4).to(torch.bfloat16)
    dtype, shape, raw = serialize_single_tensor(t)
    assert dtype == "bfloat16" and tuple(shape) == (3, 4)
    assert torch.equal(deserialize_single_tensor((dtype, shape, raw)), t)
    assert deserialize_single_tensor(serialize_single_tensor(torch.zeros(0, 3))).shape == (0, 3)
    nested = torch.nested.as_nested_tensor(
        [torch.ones(2, 3), torch.zeros(1, 3)], layout=torch.jagged
    )
    td = TensorDict(
        {"a": torch.arange(4).reshape(2, 2), "n": nested, "deep": {"b": torch.ones(2)}},
        batch_size=[2],
        device="cpu",
    )
    back = deserialize_tensordict(serialize_tensordict(td))
    assert back.batch_size == td.batch_size and str(back.device) == "cpu"
    assert torch.equal(back["a"], td["a"]) and torch.equal(back["deep", "b"], td["deep", "b"])
    assert back["n"].is_nested and [x.shape for x in back["n"].unbind()] == [(2, 3), (1, 3)]


# -- iteration, disk, info -----------------------------------------------------------------


def test_make_iterator_is_reproducible_with_a_seed() -> None:
    data = rows(8, meta={"m": 1})

    def epochs(seed: int) -> list[list[int]]:
        it = data.make_iterator(
            mini_batch_size=4, epochs=2, seed=seed, dataloader_kwargs={"shuffle": True}
        )
        return [mb.batch["idx"].tolist() for mb in it]  # type: ignore[index]

    first = epochs(1)
    assert len(first) == 4 and first == epochs(1)
    assert sorted(first[0] + first[1]) == list(range(8))
    plain = list(data.make_iterator(mini_batch_size=4, epochs=1))
    assert [mb.batch["idx"].tolist() for mb in plain] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # type: ignore[index]
    plain[0].meta_info["m"] = 2
    assert plain[1].meta_info == {"m": 1} and data.meta_info == {"m": 1}
    with pytest.raises(AssertionError, match="does not divide"):
        data.make_iterator(mini_batch_size=3, epochs=1)


def test_collate_fn_stacks_items() -> None:
    data = rows(3)
    out = collate_fn([data[2], data[0]])
    assert out.batch is not None and out.batch["idx"].tolist() == [2, 0]
    assert out.non_tensor_batch["label"].tolist() == ["l2", "l0"]


def test_save_and_load_from_disk(tmp_path: Path) -> None:
    data = rows(3)
    path = tmp_path / "d.pt"
    data.save_to_disk(path)
    back = DataProto.load_from_disk(path)
    assert back.batch is not None and torch.equal(back.batch["obs"], data.batch["obs"])  # type: ignore[index]
    assert back.non_tensor_batch["label"].tolist() == ["l0", "l1", "l2"] and back.meta_info == {
        "name": "x"
    }


def test_get_data_info_and_print_size(capsys: pytest.CaptureFixture[str]) -> None:
    data = rows(2, meta={"steps": [1, 2], "cfg": {"lr": 0.1}})
    info = data.get_data_info()
    assert "  obs: (2, 2) (torch.int64) cpu" in info
    assert "  label: ndarray(2,) (object)" in info
    assert "  steps: list[int]" in info and "  cfg: dict[str: float]" in info
    data.print_size(prefix="rows")
    assert capsys.readouterr().out.startswith("rows, Size of tensordict: ")


# -- all_gather_data_proto over a real gloo group ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gather_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        data = DataProto.from_dict(
            {"x": torch.full((2, 3), float(rank))},
            {"who": [f"r{rank}a", f"r{rank}b"]},
            {"rank": rank},
        )
        all_gather_data_proto(data, dist.group.WORLD)
        torch.save(
            {
                "x": data.batch["x"],
                "who": data.non_tensor_batch["who"].tolist(),
                "meta": data.meta_info,
            },  # type: ignore[index]
            os.path.join(out_dir, f"{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_all_gather_data_proto_on_a_two_process_gloo_group(tmp_path: Path) -> None:
    mp.spawn(_gather_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["x"][:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
        assert got["who"] == ["r0a", "r0b", "r1a", "r1b"]
        assert got["meta"] == {"rank": rank}  # meta_info stays local
