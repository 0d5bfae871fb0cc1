"""podium on one backend (``inline``, ``ray`` or ``torchrun``): one repeat of every measure."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from benchmarks._common import COLS, MIB, Sizes, gib_s, latency_ms, progress, timed
from podium import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)

MESH = "bench"


class BenchWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] * 2})


class MeshWorker(Worker):
    """dp x tp with tp fastest; only tp rank 0 of each replica answers."""

    def __init__(self, tp_size: int) -> None:
        super().__init__()
        self._register_dispatch_collect_info(
            MESH, dp_rank=self.rank // tp_size, is_collect=self.rank % tp_size == 0
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(MESH))
    def rows(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"n": torch.full((len(data),), 1, dtype=torch.int8)})


def batch(mib: int) -> DataProto:
    return DataProto.from_dict({"x": torch.randn(16 * mib, COLS)})


def _group(backend: str, n: int, cls: Any, *args: Any) -> WorkerGroup:
    return WorkerGroup(
        ResourcePool([n], use_gpu=False), ClassWithInitArgs(cls, *args), backend=backend
    )


def run(backend: str, sizes: Sizes, t0: float) -> dict[str, float]:
    """``t0``: when the child process started, before podium was imported (the cold start)."""
    out: dict[str, float] = {}
    main = _group(backend, sizes.data_workers, BenchWorker)
    try:
        main.noop()
        out["start_s"] = time.perf_counter() - t0
        progress(f"podium-{backend}: started in {out['start_s']:.1f} s")
        if sizes.wants("latency"):
            for n in sizes.latency_workers:
                if n == sizes.data_workers:
                    out[f"latency_ms@{n}"] = latency_ms(main.noop, sizes)
                    continue
                progress(f"podium-{backend}: latency at {n} workers")
                with _group(backend, n, BenchWorker) as wg:
                    out[f"latency_ms@{n}"] = latency_ms(wg.noop, sizes)
        if sizes.wants("data"):
            for mib in sizes.data_mib:
                progress(f"podium-{backend}: data at {mib} MiB")
                data = batch(mib)
                got = main.double(data)
                if not torch.equal(got.batch["y"], data.batch["x"] * 2):
                    raise RuntimeError(f"podium-{backend} returned a wrong result")
                del got
                out[f"data_gib_s@{mib}"] = gib_s(
                    mib, timed(functools.partial(main.double, data), sizes.trips(mib))
                )
                del data
    finally:
        main.shutdown()
    if sizes.wants("ndmesh"):
        progress(f"podium-{backend}: nd-mesh")
        out["ndmesh_bytes_ratio"] = _ndmesh_bytes(backend, sizes.ndmesh_mib)
    if sizes.wants("chain"):
        from benchmarks.dataplane import measure

        progress(f"podium-{backend}: chain")
        chain = measure(backend, mib=sizes.chain_mib, rounds=sizes.chain_rounds, calls=20)
        out["chain_gb_s@controller"] = chain["chain_gbps_through_controller"]
        out["chain_gb_s@batchref"] = chain["chain_gbps_batchref"]
        out["chain_controller_bytes_pct"] = chain["controller_bytes_pct"]
    return out


def _ndmesh_bytes(backend: str, mib: int) -> float:
    """Bytes podium's serializer writes in the controller for one dp=2 x tp=2 call, per batch byte."""
    from benchmarks.dataplane import serialized_bytes

    data = batch(mib)
    with _group(backend, 4, MeshWorker, 2) as wg:
        got = wg.rows(data)
        if len(got) != len(data):
            raise RuntimeError(f"nd-mesh call on podium-{backend} lost rows")
        with serialized_bytes(writes_only=True) as counted:
            wg.rows(data)
    return counted[0] / (mib * MIB)
