"""Tensors cross process boundaries as raw buffers, never through torch.save."""

from __future__ import annotations

import pickle

import torch

from podium.core.serialization import copy_via_pickle, dumps, loads


def test_tensors_travel_out_of_band_and_rebuild_on_the_buffer() -> None:
    t = torch.arange(1 << 16, dtype=torch.float32)
    header, buffers = dumps({"t": t, "n": 3})
    assert len(header) < 1024
    assert sum(b.raw().nbytes for b in buffers) == t.numel() * 4
    received = [bytearray(b.raw()) for b in buffers]
    out = loads(header, received)
    assert torch.equal(out["t"], t) and out["n"] == 3
    out["t"][0] = 42.0  # writable, and backed by the received buffer (no copy)
    assert torch.frombuffer(received[0], dtype=torch.float32)[0] == 42.0


def test_read_only_buffers_are_copied_into_writable_tensors() -> None:
    t = torch.ones(8, dtype=torch.bfloat16).reshape(2, 4)
    header, buffers = dumps(t)
    out = loads(header, [bytes(b.raw()) for b in buffers])
    out += 1
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4) and float(out.sum()) == 16.0


def test_views_empty_tensors_and_parameters() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    view = base.t()[1:]
    empty = torch.empty(0, 3)
    param = torch.nn.Parameter(torch.ones(2))
    out = copy_via_pickle((view, empty, param))
    assert torch.equal(out[0], view) and out[1].shape == (0, 3)
    assert isinstance(out[2], torch.nn.Parameter)


def test_no_torch_save_in_the_stream() -> None:
    header, _ = dumps(torch.zeros(4))
    assert b"_load_from_bytes" not in header and b"torch.storage" not in header
    # A plain pickle of a tensor does go through torch's storage reduction.
    assert b"_load_from_bytes" in pickle.dumps(torch.zeros(4)) or b"storage" in pickle.dumps(torch.zeros(4))


def test_lambdas_and_local_classes_travel_by_value() -> None:
    class Local:
        def __init__(self, v: int) -> None:
            self.v = v

    fn = lambda x: Local(x).v * 2  # noqa: E731
    header, buffers = dumps(fn)
    assert loads(header, buffers)(21) == 42
