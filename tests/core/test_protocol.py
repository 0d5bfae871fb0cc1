"""Unit tests for ``podium.core.protocol`` (DataProto): in-process, no workers."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from podium.core import protocol, serialization
from podium.core.protocol import (
    DataProto,
    DataProtoItem,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)
from podium.errors import DataProtoError


def make(n: int = 6, meta: dict | None = None, **kwargs) -> DataProto:
    return DataProto.from_dict(
        tensors={"obs": torch.arange(n * 2).reshape(n, 2), "rew": torch.arange(n).float()},
        non_tensors={"uid": [f"u{i}" for i in range(n)]},
        meta_info={"temperature": 1.0} if meta is None else meta,
        **kwargs,
    )


def rows(data: DataProto) -> list[int]:
    """The original row numbers, read from ``rew``."""
    assert data.batch is not None
    return [int(x) for x in data.batch["rew"]]


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    if a.batch is None:
        assert b.batch is None
    else:
        assert b.batch is not None
        assert (a.batch == b.batch).all()
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for k in a.non_tensor_batch:
        assert list(a.non_tensor_batch[k]) == list(b.non_tensor_batch[k])
    assert a.meta_info == b.meta_info
    assert a.auto_padding == b.auto_padding


def test_all_names_resolve():
    for name in protocol.__all__:
        assert getattr(protocol, name) is not None


# -- construction and validation ------------------------------------------


def test_from_dict_builds_batch_and_object_arrays():
    data = make(4)
    assert len(data) == 4
    assert data.batch is not None and data.batch.batch_size == torch.Size([4])
    uid = data.non_tensor_batch["uid"]
    assert isinstance(uid, np.ndarray) and uid.dtype == object and uid.shape == (4,)
    assert data.meta_info == {"temperature": 1.0}
    assert data.auto_padding is False


def test_list_of_lists_stays_one_object_per_row():
    data = DataProto.from_dict(non_tensors={"tok": [[1, 2], [3, 4], [5, 6]]})
    assert data.non_tensor_batch["tok"].shape == (3,)
    assert data.non_tensor_batch["tok"][1] == [3, 4]
    assert data.batch is None and len(data) == 3


def test_from_dict_refuses_more_than_one_batch_dim():
    # As verl: a DataProto has one batch dim (fold_batch_dim groups rows instead).
    with pytest.raises(DataProtoError, match="exactly one batch dimension"):
        DataProto.from_dict({"x": torch.zeros(4, 3, 2)}, num_batch_dims=2)
    with pytest.raises(DataProtoError, match="exactly one batch dimension"):
        DataProto(batch=TensorDict({"x": torch.zeros(4, 3)}, batch_size=[4, 3]))


def test_from_dict_nested_tensors():
    data = DataProto.from_dict({"x": torch.zeros(4), "sub": {"y": torch.ones(4, 2)}})
    assert data.batch is not None
    assert data.batch["sub", "y"].shape == (4, 2)


def test_from_dict_mismatched_tensors_name_both():
    with pytest.raises(ValueError, match=r"'b'.*\[3\].*'a'.*\[4\]"):
        DataProto.from_dict({"a": torch.zeros(4), "b": torch.zeros(3)})


def test_from_dict_rejects_non_tensor_in_tensors():
    with pytest.raises(TypeError, match="'a'.*non_tensors"):
        DataProto.from_dict({"a": [1, 2]})


def test_inconsistent_non_tensor_length_names_key_and_sizes():
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] has 3 rows.*batch.*4"):
        DataProto.from_dict({"a": torch.zeros(4)}, {"uid": ["x", "y", "z"]})


def test_non_tensors_disagreeing_with_each_other():
    with pytest.raises(ValueError, match=r"'b'.*2 rows.*'a'.*3"):
        DataProto(non_tensor_batch={"a": [1, 2, 3], "b": [1, 2]})


def test_batch_needs_a_batch_dim():
    with pytest.raises(ValueError, match="exactly one batch dimension"):
        DataProto(batch=TensorDict({"a": torch.zeros(3)}, batch_size=[]))


def test_bad_types_are_type_errors():
    with pytest.raises(TypeError, match="batch must be a TensorDict"):
        DataProto(batch={"a": torch.zeros(3)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"non_tensor_batch\['x'\].*tensors belong in batch"):
        DataProto(non_tensor_batch={"x": torch.zeros(3)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="0-d array"):
        DataProto(non_tensor_batch={"x": np.array(3)})


def test_constructor_does_not_alias_callers_dicts():
    nt = {"uid": ["a", "b"]}
    meta = {"k": 1}
    data = DataProto(non_tensor_batch=nt, meta_info=meta)  # type: ignore[arg-type]
    data.meta_info["k"] = 2
    data.non_tensor_batch["new"] = np.array([1, 2])
    assert meta == {"k": 1}
    assert nt == {"uid": ["a", "b"]}  # the list was converted in DataProto's dict only


def test_from_single_dict_sorts_values():
    data = DataProto.from_single_dict(
        {"x": torch.zeros(3), "s": np.array(["a", "b", "c"], dtype=object), "l": [1, 2, 3]},
        meta_info={"m": 1},
        auto_padding=True,
    )
    assert data.batch is not None and list(data.batch.keys()) == ["x"]
    assert set(data.non_tensor_batch) == {"s", "l"}
    assert data.meta_info == {"m": 1} and data.auto_padding
    with pytest.raises(TypeError, match="'bad'"):
        DataProto.from_single_dict({"bad": 3})


def test_empty_dataproto():
    data = DataProto()
    assert len(data) == 0
    assert data.chunk(2)[0].batch is None
    assert len(DataProto.concat([data, data])) == 0


# -- tensordict round trip ---------------------------------------------------


def test_tensordict_round_trip():
    data = make(4, meta={"temperature": 0.5, "cfg": {"a": 1}})
    td = data.to_tensordict()
    assert isinstance(td.get("uid"), NonTensorStack)
    assert isinstance(td.get("temperature"), NonTensorData)
    assert td[1]["uid"] == "u1"
    back = DataProto.from_tensordict(td)
    assert_same(back, data)
    # the source objects are untouched
    assert data.batch is not None and set(data.batch.keys()) == {"obs", "rew"}
    assert "uid" in td.keys()


def test_from_plain_tensordict():
    td = TensorDict({"x": torch.arange(3), "n": {"y": torch.ones(3)}}, batch_size=[3])
    data = DataProto.from_tensordict(td, meta_info={"m": 1})
    assert data.batch is not None and data.batch is not td
    assert torch.equal(data.batch["n", "y"], torch.ones(3))
    assert data.meta_info == {"m": 1} and data.non_tensor_batch == {}


def test_to_tensordict_key_clash():
    data = DataProto.from_dict({"x": torch.zeros(2)}, meta_info={"x": 1})
    with pytest.raises(ValueError, match=r"\['x'\]"):
        data.to_tensordict()


def test_to_tensordict_without_batch():
    data = DataProto(non_tensor_batch={"s": ["a", "b"]})
    td = data.to_tensordict()
    assert td.batch_size == torch.Size([2])
    assert list(DataProto.from_tensordict(td).non_tensor_batch["s"]) == ["a", "b"]


# -- indexing --------------------------------------------------------------


def test_int_index_gives_item():
    data = make(4)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch is not None and int(item.batch["rew"]) == 2
    assert item.non_tensor_batch == {"uid": "u2"}
    assert item.meta_info == data.meta_info and item.meta_info is not data.meta_info
    last = data[-1]
    assert isinstance(last, DataProtoItem) and last.non_tensor_batch["uid"] == "u3"
    with pytest.raises(IndexError, match="index 4 is out of range.*length 4"):
        data[4]
    assert [it.non_tensor_batch["uid"] for it in data] == ["u0", "u1", "u2", "u3"]


@pytest.mark.parametrize(
    "index, expected",
    [
        (slice(1, 3), [1, 2]),
        (slice(None, None, 2), [0, 2, 4]),
        (slice(None, None, -2), [5, 3, 1]),
        ([4, 0, 4], [4, 0, 4]),
        (np.array([5, -1]), [5, 5]),
        (torch.tensor([3, 1]), [3, 1]),
        ([True, False, True, False, False, True], [0, 2, 5]),
        (np.array([False] * 5 + [True]), [5]),
        (torch.tensor([True, True, False, False, False, False]), [0, 1]),
        ([], []),
    ],
)
def test_index_gives_dataproto(index, expected):
    data = make(6)
    out = data[index]
    assert isinstance(out, DataProto)
    assert rows(out) == expected
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in expected]
    assert out.meta_info == data.meta_info and out.meta_info is not data.meta_info


def test_bad_indices():
    data = make(4)
    with pytest.raises(IndexError, match="mask has length 3.*length 4"):
        data[[True, False, True]]
    with pytest.raises(IndexError, match="index 9 is out of range"):
        data[[0, 9]]
    with pytest.raises(TypeError, match="ints or bools"):
        data[np.array([0.5])]


def test_slice_method():
    data = make(6)
    assert rows(data.slice(1, 5, 2)) == [1, 3]
    assert rows(data.slice(4)) == [4, 5]


# -- keys --------------------------------------------------------------------


def test_select():
    data = make(4, meta={"a": 1, "b": [1]})
    sel = data.select(batch_keys=["obs"], non_tensor_batch_keys=[], meta_info_keys=["b"])
    assert sel.batch is not None and list(sel.batch.keys()) == ["obs"]
    assert sel.non_tensor_batch == {} and sel.meta_info == {"b": [1]}
    assert sel.batch["obs"].data_ptr() == data.batch["obs"].data_ptr()  # type: ignore[index]
    everything = data.select()
    assert_same(everything, data)
    deep = data.select(meta_info_keys=["b"], deepcopy=True)
    deep.meta_info["b"].append(2)
    deep.batch["obs"][0, 0] = 100  # type: ignore[index]
    assert data.meta_info["b"] == [1] and int(data.batch["obs"][0, 0]) == 0  # type: ignore[index]
    with pytest.raises(KeyError, match="batch has no key.*'nope'"):
        data.select(batch_keys=["nope"])
    # As verl: non-tensor and meta keys that are not there are skipped.
    assert data.select(meta_info_keys=["zz", "a"]).meta_info == {"a": 1}
    assert data.select(non_tensor_batch_keys=["zz"]).non_tensor_batch == {}


def test_pop_is_in_place():
    data = make(4, meta={"a": 1, "b": 2})
    popped = data.pop(batch_keys=["obs"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert popped.batch is not None and list(popped.batch.keys()) == ["obs"]
    assert list(popped.non_tensor_batch) == ["uid"] and popped.meta_info == {"a": 1}
    assert data.batch is not None and list(data.batch.keys()) == ["rew"]
    assert data.non_tensor_batch == {} and data.meta_info == {"b": 2}
    assert len(popped) == len(data) == 4


def test_pop_checks_all_keys_before_removing():
    data = make(4)
    with pytest.raises(KeyError, match="non_tensor_batch has no key"):
        data.pop(batch_keys=["obs"], non_tensor_batch_keys=["missing"])
    assert data.batch is not None and set(data.batch.keys()) == {"obs", "rew"}


def test_rename_is_in_place_and_returns_self():
    data = make(3)
    out = data.rename(["obs", "uid"], ["observation", "id"])
    assert out is data  # as in verl
    assert out.batch is not None and set(out.batch.keys()) == {"observation", "rew"}
    assert set(out.non_tensor_batch) == {"id"}
    assert set(data.rename("rew", "r").batch.keys()) == {"observation", "r"}  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="'r' already exists"):
        data.rename("observation", "r")
    with pytest.raises(ValueError, match="already exists"):
        data.rename(["id", "r"], ["x", "observation"])  # checked before anything changes
    assert set(data.non_tensor_batch) == {"id"}
    with pytest.raises(KeyError, match="'zz'"):
        data.rename("zz", "yy")
    with pytest.raises(ValueError, match="2 old and 1 new"):
        data.rename(["obs", "rew"], ["x"])


def test_union():
    a = make(4, meta={"m": 1})
    b = DataProto.from_dict(
        {"obs": a.batch["obs"].clone(), "adv": torch.ones(4)},  # type: ignore[index]
        {"uid": list(a.non_tensor_batch["uid"]), "extra": [1, 2, 3, 4]},
        {"m": 1, "n": 2},
    )
    u = a.union(b)
    assert u is a  # in place, as in verl
    assert u.batch is not None and set(u.batch.keys()) == {"obs", "rew", "adv"}
    assert set(u.non_tensor_batch) == {"uid", "extra"}
    assert u.meta_info == {"m": 1, "n": 2}
    assert set(b.batch.keys()) == {"obs", "adv"}  # type: ignore[union-attr]  # other untouched


@pytest.mark.parametrize(
    "other, match",
    [
        (lambda a: DataProto.from_dict({"rew": torch.zeros(4)}), "batch key 'rew' differs"),
        (lambda a: DataProto(non_tensor_batch={"uid": ["x"] * 4}), "non_tensor_batch key 'uid'"),
        (lambda a: DataProto(meta_info={"temperature": 2.0}), "meta_info key 'temperature'"),
        (lambda a: make(3), "length 4 and 3"),
    ],
)
def test_union_conflicts(other, match):
    a = make(4)
    with pytest.raises(ValueError, match=match):
        a.union(other(a))


def test_union_compares_object_arrays_of_arrays():
    arrs = [np.arange(i + 1) for i in range(3)]
    a = DataProto(non_tensor_batch={"x": arrs})  # type: ignore[dict-item]
    b = DataProto(non_tensor_batch={"x": [x.copy() for x in arrs]})  # type: ignore[dict-item]
    assert len(a.union(b)) == 3


# -- reshaping -----------------------------------------------------------------


def test_reorder_in_place():
    data = make(4)
    data.reorder(torch.tensor([3, 1, 2, 0]))
    assert rows(data) == [3, 1, 2, 0]
    assert list(data.non_tensor_batch["uid"]) == ["u3", "u1", "u2", "u0"]


def test_chunk():
    data = make(6)
    chunks = data.chunk(3)
    assert [rows(c) for c in chunks] == [[0, 1], [2, 3], [4, 5]]
    assert [list(c.non_tensor_batch["uid"]) for c in chunks][2] == ["u4", "u5"]
    with pytest.raises(ValueError, match=r"length 6 cannot be split into 4 equal chunks"):
        data.chunk(4)
    with pytest.raises(ValueError, match="positive int"):
        data.chunk(0)


def test_chunks_do_not_share_dicts():
    data = make(4, meta={"temperature": 1.0})
    chunks = data.chunk(2)
    chunks[0].meta_info["temperature"] = 9.0
    chunks[0].meta_info["added"] = True
    chunks[0].non_tensor_batch["new"] = np.array([1, 2])
    chunks[0].batch.set("new", torch.zeros(2))  # type: ignore[union-attr]
    assert chunks[1].meta_info == {"temperature": 1.0}
    assert data.meta_info == {"temperature": 1.0}
    assert "new" not in chunks[1].non_tensor_batch and "new" not in data.non_tensor_batch
    assert "new" not in chunks[1].batch.keys() and "new" not in data.batch.keys()  # type: ignore[union-attr]
    assert len({id(c.meta_info) for c in chunks + data.split(1)}) == 2 + 4


def test_split():
    data = make(5)
    parts = data.split(2)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4]]
    assert parts[0].meta_info is not parts[1].meta_info
    with pytest.raises(ValueError, match="split_size"):
        data.split(0)


def test_concat_round_trips_chunks():
    data = make(6)
    assert_same(DataProto.concat(data.chunk(3)), data)
    assert_same(DataProto.concat(data.split(4)), data)


def test_concat_meta_info_rules():
    a = make(2, meta={"t": 1, "metrics": {"loss": 0.5}})
    b = make(2, meta={"t": 1, "extra": "x", "metrics": {"loss": 0.7}})
    out = DataProto.concat([a, b])
    assert out.meta_info == {"t": 1, "extra": "x", "metrics": {"loss": [0.5, 0.7]}}
    assert a.meta_info["metrics"] == {"loss": 0.5}  # input untouched
    c = make(2, meta={"t": 2})
    with pytest.raises(DataProtoError, match="Conflicting values for meta_info key 't'") as err:
        DataProto.concat([a, c])
    assert isinstance(err.value, AssertionError)  # as verl's assert
    none = make(2, meta={"t": 1, "metrics": None})
    assert DataProto.concat([a, none]).meta_info["metrics"] == {"loss": [0.5]}


def test_concat_errors():
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])
    with pytest.raises(ValueError, match="batch keys of item 1"):
        DataProto.concat([make(2), make(2).select(batch_keys=["obs"])])
    with pytest.raises(ValueError, match="non_tensor_batch keys of item 1"):
        DataProto.concat([make(2), make(2).select(non_tensor_batch_keys=[])])
    with pytest.raises(ValueError, match="some DataProtos have a batch"):
        DataProto.concat([make(2), DataProto(non_tensor_batch={"uid": ["a", "b"]})])
    with pytest.raises(TypeError, match="item 1 is a str"):
        DataProto.concat([make(2), "x"])  # type: ignore[list-item]


def test_repeat():
    data = make(3)
    assert rows(data.repeat(2, interleave=True)) == [0, 0, 1, 1, 2, 2]
    tiled = data.repeat(repeat_times=3, interleave=False)
    assert rows(tiled) == [0, 1, 2] * 3
    assert list(tiled.non_tensor_batch["uid"]) == ["u0", "u1", "u2"] * 3
    assert len(data) == 3
    with pytest.raises(ValueError, match="repeat_times"):
        data.repeat(0)


def test_to_device_is_in_place_and_returns_self():
    data = make(2)
    before = copy.copy(data)
    moved = data.to("cpu")
    assert moved is data  # as in verl: data.to(device) without assignment works
    assert_same(moved, before)


def test_copy_and_deepcopy_are_independent():
    data = make(3, meta={"lst": [1]})
    for dup in (data.copy(), copy.deepcopy(data)):
        dup.batch["obs"][0, 0] = 99  # type: ignore[index]
        dup.meta_info["lst"].append(2)
        dup.non_tensor_batch["uid"][0] = "changed"
    assert int(data.batch["obs"][0, 0]) == 0  # type: ignore[index]
    assert data.meta_info["lst"] == [1] and data.non_tensor_batch["uid"][0] == "u0"
    shallow = copy.copy(data)
    shallow.meta_info["new"] = 1
    shallow.batch.set("new", torch.zeros(3))  # type: ignore[union-attr]
    assert "new" not in data.meta_info and "new" not in data.batch.keys()  # type: ignore[union-attr]


def test_repr_is_short():
    text = repr(make(4, auto_padding=True))
    assert text.startswith("DataProto(len=4")
    assert "obs: int64[4, 2]" in text and "uid: object[4]" in text and "auto_padding=True" in text
    assert len(text) < 200


# -- padding -------------------------------------------------------------------


def test_pad_and_unpad():
    data = make(5)
    padded, pad = pad_dataproto_to_divisor(data, 4)
    assert pad == 3 and len(padded) == 8
    assert rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert list(padded.non_tensor_batch["uid"])[5:] == ["u0", "u1", "u2"]
    assert len(data) == 5  # input untouched
    assert padded.meta_info == data.meta_info and padded.meta_info is not data.meta_info
    assert_same(unpad_dataproto(padded, pad), data)


def test_pad_larger_than_length_repeats_cyclically():
    data = make(2)
    padded, pad = pad_dataproto_to_divisor(data, 7)
    assert pad == 5
    assert rows(padded) == [0, 1, 0, 1, 0, 1, 0]
    assert_same(unpad_dataproto(padded, pad), data)


def test_pad_noop_returns_new_object():
    data = make(4, meta={"metrics": {"loss": 1.0}})
    padded, pad = pad_dataproto_to_divisor(data, 2)
    assert pad == 0 and padded is not data and padded.meta_info is not data.meta_info
    assert_same(padded, data)
    assert unpad_dataproto(data, 0) is data


def test_pad_keeps_meta_info_verbatim():
    data = make(3, meta={"metrics": {"loss": 1.0}}, auto_padding=True)
    padded, _ = pad_dataproto_to_divisor(data, 2)
    assert padded.meta_info == {"metrics": {"loss": 1.0}}
    assert padded.auto_padding


def test_pad_unpad_bad_arguments():
    with pytest.raises(ValueError, match="size_divisor"):
        pad_dataproto_to_divisor(make(2), 0)
    with pytest.raises(ValueError, match="cannot remove 5 pad rows.*length 2"):
        unpad_dataproto(make(2), 5)
    with pytest.raises(ValueError, match="pad_size"):
        unpad_dataproto(make(2), -1)


# -- pickling ------------------------------------------------------------------


def test_pickle_is_flat_and_round_trips_nested_keys():
    data = DataProto.from_dict(
        {"x": torch.arange(4), "sub": {"y": torch.ones(4, 2), "deeper": {"z": torch.zeros(4)}}},
        {"s": ["a", "b", "c", "d"]},
        {"m": 1},
        auto_padding=True,
    )
    state = data.__getstate__()
    assert set(state["tensors"]) == {"x", ("sub", "y"), ("sub", "deeper", "z")}
    assert all(type(t) is torch.Tensor for t in state["tensors"].values())
    back = pickle.loads(pickle.dumps(data))
    assert_same(back, data)
    assert back.batch is not None and torch.equal(back.batch["sub", "deeper", "z"], torch.zeros(4))
    assert back.batch.batch_size == torch.Size([4])


def test_pickle_without_batch():
    data = DataProto(non_tensor_batch={"s": ["a"]}, meta_info={"k": 1})
    assert_same(pickle.loads(pickle.dumps(data)), data)


def test_serializer_sends_tensor_data_out_of_band():
    n = 1024
    data = DataProto.from_dict(
        {
            "a": torch.randn(n, 8 * 1024),  # 32 MiB
            "b": torch.randint(0, 100, (n, 4 * 1024)),  # 32 MiB
            "nest": {"c": torch.ones(n, dtype=torch.bool)},
        },
        {"uid": [str(i) for i in range(n)]},
        {"temperature": 0.7},
    )
    tensor_bytes = sum(
        t.numel() * t.element_size() for t in data.__getstate__()["tensors"].values()
    )
    assert tensor_bytes >= 64 * 1024 * 1024
    header, buffers = serialization.dumps(data)
    assert len(header) < 64 * 1024  # the uid strings and the structure, nothing more
    assert sum(b.raw().nbytes for b in buffers) == tensor_bytes
    received = [bytearray(b.raw()) for b in buffers]  # what a transport delivers
    back = serialization.loads(header, received)
    assert isinstance(back, DataProto)
    assert_same(back, data)
    assert back.batch is not None
    back.batch["a"][0, 0] = 123.0  # writable, on the received memory
    assert float(data.batch["a"][0, 0]) != 123.0  # type: ignore[index]


def test_copy_via_pickle_round_trip():
    data = make(4)
    assert_same(serialization.copy_via_pickle(data), data)


def test_concat_of_large_tensors_matches_torch_cat():
    # Above 1 MiB the rows are joined through numpy; dtypes numpy lacks must survive.
    parts = [
        DataProto.from_dict(
            {
                "f": torch.randn(300, 1024),
                "b": torch.randn(300, 2048).to(torch.bfloat16),
                "nested": {"i": torch.arange(300 * 1024).reshape(300, 1024) + k},
            }
        )
        for k in range(3)
    ]
    out = DataProto.concat(parts)
    for key in ("f", "b", ("nested", "i")):
        expected = torch.cat([p.batch[key] for p in parts])
        assert out.batch[key].dtype == expected.dtype and torch.equal(out.batch[key], expected)
    out.batch["f"][0, 0] = 123.0  # an ordinary writable tensor that shares nothing with the parts
    assert parts[0].batch["f"][0, 0] != 123.0
