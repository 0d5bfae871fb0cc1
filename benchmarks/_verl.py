"""verl 0.9.1's ``RayWorkerGroup``, run under the interpreter of its own venv
(``benchmarks/make-verl-venv.sh``): the same measures as podium's, the same workers."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import ray
import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import (
    Dispatch,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

from benchmarks._common import COLS, MIB, Sizes, gib_s, latency_ms, timed

MESH = "bench"


class VerlBenchWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] * 2})


class VerlMeshWorker(Worker):
    def __init__(self, tp_size: int) -> None:
        super().__init__()
        self._register_dispatch_collect_info(
            MESH, dp_rank=self.rank // tp_size, is_collect=self.rank % tp_size == 0
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(MESH))
    def rows(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"n": torch.full((len(data),), 1, dtype=torch.int8)})


def _group(n: int, cls: Any, *args: Any) -> RayWorkerGroup:
    # max_colocate_count=1: verl's CPU bundle otherwise asks for 10 CPUs per worker.
    pool = RayResourcePool([n], use_gpu=False, max_colocate_count=1)
    return RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(cls), *args), device_name="cpu")


def _ray_serialized_bytes() -> tuple[list[int], Any]:
    """Count what Ray serializes in this process (verl's arguments are Ray task arguments)."""
    from ray._private.serialization import SerializationContext

    total = [0]
    original = SerializationContext.serialize

    def counting(self: Any, value: Any) -> Any:
        serialized = original(self, value)
        total[0] += int(getattr(serialized, "total_bytes", 0))
        return serialized

    SerializationContext.serialize = counting  # type: ignore[method-assign]

    def restore() -> None:
        SerializationContext.serialize = original  # type: ignore[method-assign]

    return total, restore


def run(sizes: Sizes, t0: float) -> dict[str, float]:
    ray.init(num_cpus=max(os.cpu_count() or 1, 64), include_dashboard=False, log_to_driver=False)
    out: dict[str, float] = {}
    try:
        main = _group(sizes.data_workers, VerlBenchWorker)
        main.noop()
        out["start_s"] = time.perf_counter() - t0
        if sizes.wants("latency"):
            for n in sizes.latency_workers:
                wg = main if n == sizes.data_workers else _group(n, VerlBenchWorker)
                out[f"latency_ms@{n}"] = latency_ms(wg.noop, sizes)
        if sizes.wants("data"):
            for mib in sizes.data_mib:
                data = DataProto.from_dict({"x": torch.randn(16 * mib, COLS)})
                got = main.double(data)
                if not torch.equal(got.batch["y"], data.batch["x"] * 2):
                    raise RuntimeError("verl returned a wrong result")
                del got
                out[f"data_gib_s@{mib}"] = gib_s(
                    mib, timed(functools.partial(main.double, data), sizes.trips(mib))
                )
        if sizes.wants("ndmesh"):
            mesh = _group(4, VerlMeshWorker, 2)
            data = DataProto.from_dict({"x": torch.randn(16 * sizes.ndmesh_mib, COLS)})
            mesh.rows(data)
            counted, restore = _ray_serialized_bytes()
            try:
                mesh.rows(data)
            finally:
                restore()
            out["ndmesh_bytes_ratio"] = counted[0] / (sizes.ndmesh_mib * MIB)
    finally:
        ray.shutdown()
    return out
