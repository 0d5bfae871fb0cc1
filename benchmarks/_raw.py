"""Raw Ray actors, no framework: the floor podium-ray's overhead is measured against.

Latency and start use numpy payloads' implementation (``raw-ray``); the round trip is
measured with numpy shards (Ray's zero-copy path) and with torch tensors (``raw-ray-torch``).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np
import ray
import torch

from benchmarks._common import COLS, Sizes, gib_s, latency_ms, timed


@ray.remote
class RawWorker:
    def noop(self) -> None:
        return None

    def double(self, x: Any) -> Any:
        return x * 2


def _noops(actors: list[Any]) -> None:
    ray.get([a.noop.remote() for a in actors])


def run(sizes: Sizes, t0: float) -> dict[str, float]:
    ray.init(num_cpus=max(os.cpu_count() or 1, 64), include_dashboard=False, log_to_driver=False)
    out: dict[str, float] = {}
    try:
        actors = [
            RawWorker.remote()  # type: ignore[attr-defined]
            for _ in range(max(sizes.latency_workers + (sizes.data_workers,)))
        ]
        main = actors[: sizes.data_workers]
        ray.get([a.noop.remote() for a in main])
        out["start_s"] = time.perf_counter() - t0
        if sizes.wants("latency"):
            for n in sizes.latency_workers:
                some = actors[:n]
                out[f"latency_ms@{n}"] = latency_ms(functools.partial(_noops, some), sizes)
        if sizes.wants("data"):
            for mib in sizes.data_mib:
                x = np.random.randn(16 * mib, COLS).astype(np.float32)
                xt = torch.from_numpy(x.copy())

                def numpy_trip(x: np.ndarray = x) -> np.ndarray:
                    parts = np.array_split(x, len(main))
                    return np.concatenate(
                        ray.get([a.double.remote(p) for a, p in zip(main, parts)])
                    )

                def torch_trip(xt: torch.Tensor = xt) -> torch.Tensor:
                    parts = xt.chunk(len(main))
                    return torch.cat(ray.get([a.double.remote(p) for a, p in zip(main, parts)]))

                if not np.array_equal(numpy_trip(), x * 2) or not torch.equal(torch_trip(), xt * 2):
                    raise RuntimeError("raw Ray returned a wrong result")
                out[f"data_gib_s@{mib}"] = gib_s(mib, timed(numpy_trip, sizes.trips(mib)))
                out[f"raw-ray-torch:data_gib_s@{mib}"] = gib_s(
                    mib, timed(torch_trip, sizes.trips(mib))
                )
    finally:
        ray.shutdown()
    return out
