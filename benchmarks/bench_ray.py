"""podium's Ray backend next to verl's RayWorkerGroup and raw Ray actors, 4 CPU workers.

Three figures, each measured the same way for every contender:

- **latency**: a no-op call on every rank (``ONE_TO_ALL``), median over many calls;
- **throughput**: a ``DP_COMPUTE_PROTO`` round trip of a 64 MiB float32 batch
  (split over the ranks, echoed back, gathered), in GiB/s of batch;
- **start**: pool + 4 workers until the first call returns.

Each contender runs in its own process with its own fresh local Ray, started
with the same settings, one after the other in one run; several rounds
alternate them and the medians are shown (a shared machine is noisy). verl lives in a
separate virtual environment (it is not a podium dependency); point
``--verl-python`` (or ``$VERL_PYTHON``) at its interpreter, e.g.::

    python -m venv /tmp/verl-venv
    /tmp/verl-venv/bin/pip install torch==2.13.0
    /tmp/verl-venv/bin/pip install --no-deps verl==0.9.1
    /tmp/verl-venv/bin/pip install ray 'tensordict<=0.10.0' omegaconf 'transformers<5.11'

Without it the verl column is skipped with a note.

Usage: ``python benchmarks/bench_ray.py [--verl-python PATH] [--rounds 3] [--iters 200] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

WORKERS = 4
BATCH_BYTES = 64 * 1024 * 1024
ROWS, COLS = 4096, BATCH_BYTES // 4 // 4096  # float32
RAY_INIT = {"num_cpus": 8, "include_dashboard": False, "log_to_driver": False}


def _timed(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _summary(start_s: float, lat: list[float], rt: list[float], **extra: Any) -> dict[str, Any]:
    gib = BATCH_BYTES / 2**30
    return {
        "start_s": start_s,
        "latency_ms_median": statistics.median(lat) * 1e3,
        "latency_ms_p90": sorted(lat)[int(0.9 * len(lat))] * 1e3,
        "throughput_gib_s_median": gib / statistics.median(rt),
        "throughput_gib_s_best": gib / min(rt),
        **extra,
    }


def _ray_up() -> None:
    import ray

    ray.init(**RAY_INIT)
    time.sleep(2.0)  # let Ray's prestarted workers settle, the same for everyone


# -- contenders (each runs in its own process) ---------------------------------------


def part_podium(iters: int) -> dict[str, Any]:
    import torch

    from podium import (
        ClassWithInitArgs,
        DataProto,
        Dispatch,
        ResourcePool,
        Worker,
        WorkerGroup,
        register,
    )

    class BenchWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def noop(self) -> None:
            return None

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def echo(self, data: DataProto) -> DataProto:
            return data

    _ray_up()
    t = time.perf_counter()
    wg = WorkerGroup(
        ResourcePool([WORKERS], use_gpu=False), ClassWithInitArgs(BenchWorker), backend="ray"
    )
    wg.noop()
    start_s = time.perf_counter() - t
    lat = _timed(wg.noop, iters, warmup=20)
    batch = DataProto.from_dict({"x": torch.randn(ROWS, COLS)})
    out = wg.echo(batch)
    if not torch.equal(out.batch["x"], batch.batch["x"]):
        raise RuntimeError("podium echo returned different data")
    rt = _timed(lambda: wg.echo(batch), max(3, iters // 40), warmup=1)
    wg.shutdown()
    return _summary(start_s, lat, rt)


def part_raw(iters: int) -> dict[str, Any]:
    import numpy as np
    import ray
    import torch

    @ray.remote
    class Raw:
        def noop(self) -> None:
            return None

        def echo(self, x: Any) -> Any:
            return x

    _ray_up()
    t = time.perf_counter()
    actors = [Raw.options(num_cpus=1).remote() for _ in range(WORKERS)]
    ray.get([a.noop.remote() for a in actors])
    start_s = time.perf_counter() - t
    lat = _timed(lambda: ray.get([a.noop.remote() for a in actors]), iters, warmup=20)
    x = np.random.randn(ROWS, COLS).astype(np.float32)

    def numpy_round_trip() -> Any:
        parts = ray.get([a.echo.remote(c) for a, c in zip(actors, np.array_split(x, WORKERS))])
        return np.concatenate(parts)

    if not np.array_equal(numpy_round_trip(), x):
        raise RuntimeError("raw Ray echo returned different data")
    rt = _timed(numpy_round_trip, max(3, iters // 40), warmup=1)
    xt = torch.from_numpy(x)

    def torch_round_trip() -> Any:
        return torch.cat(ray.get([a.echo.remote(c) for a, c in zip(actors, xt.chunk(WORKERS))]))

    rt_torch = _timed(torch_round_trip, max(3, iters // 40), warmup=1)
    gib = BATCH_BYTES / 2**30
    return _summary(
        start_s, lat, rt, torch_throughput_gib_s_median=gib / statistics.median(rt_torch)
    )


def part_verl(iters: int) -> dict[str, Any]:
    import ray
    import torch
    from verl import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    class VerlBenchWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def noop(self) -> None:
            return None

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def echo(self, data: DataProto) -> DataProto:
            return data

    _ray_up()
    t = time.perf_counter()
    # max_colocate_count=1: verl's CPU bundle asks for max_colocate_count CPUs (default 10).
    pool = RayResourcePool([WORKERS], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(VerlBenchWorker)))
    wg.noop()
    start_s = time.perf_counter() - t
    lat = _timed(wg.noop, iters, warmup=20)
    batch = DataProto.from_dict({"x": torch.randn(ROWS, COLS)})
    out = wg.echo(batch)
    if not torch.equal(out.batch["x"], batch.batch["x"]):
        raise RuntimeError("verl echo returned different data")
    rt = _timed(lambda: wg.echo(batch), max(3, iters // 40), warmup=1)
    return _summary(start_s, lat, rt)


PARTS = {"podium": part_podium, "raw": part_raw, "verl": part_verl}


# -- driver ------------------------------------------------------------------------


def _run_part(python: str, part: str, iters: int) -> dict[str, Any]:
    proc = subprocess.run(
        [python, os.path.abspath(__file__), "--part", part, "--iters", str(iters)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    return json.loads(lines[-1])


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    return {k: statistics.median(r[k] for r in ok) for k in ok[0]} | {"rounds": len(ok)}


def _table(results: dict[str, dict[str, Any]]) -> str:
    rows = [f"{'':16}{'latency ms (median)':>22}{'GiB/s (median)':>17}{'start s':>10}"]
    for name, r in results.items():
        if "error" in r or "skipped" in r:
            rows.append(f"{name:16}{r.get('skipped') or r['error'][:200]}")
            continue
        rows.append(
            f"{name:16}{r['latency_ms_median']:>22.2f}{r['throughput_gib_s_median']:>17.3f}{r['start_s']:>10.2f}"
        )
        if "torch_throughput_gib_s_median" in r:
            rows.append(
                f"{'raw Ray (torch)':16}{'':>22}{r['torch_throughput_gib_s_median']:>17.3f}"
            )
    p, v, w = results.get("podium", {}), results.get("verl", {}), results.get("raw Ray (numpy)", {})
    if "latency_ms_median" in p:
        rows.append("")
        if "latency_ms_median" in v:
            rows.append(
                f"podium/verl latency    {p['latency_ms_median'] / v['latency_ms_median']:.2f}x (target <= 1)"
            )
            rows.append(
                f"podium/verl throughput {p['throughput_gib_s_median'] / v['throughput_gib_s_median']:.2f}x (target >= 2.5)"
            )
            rows.append(f"podium/verl start      {p['start_s'] / v['start_s']:.2f}x (target <= 1)")
        if "latency_ms_median" in w:
            rows.append(
                f"podium/raw throughput  {p['throughput_gib_s_median'] / w['throughput_gib_s_median']:.2f}x (target >= 0.9)"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=200, help="no-op calls timed per contender")
    parser.add_argument(
        "--verl-python",
        default=os.environ.get("VERL_PYTHON"),
        help="interpreter of a venv with verl 0.9.1",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of every contender; medians are shown"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.part:
        print(json.dumps(PARTS[args.part](args.iters)))
        return
    runs: dict[str, list[dict[str, Any]]] = {}
    contenders = [("podium", sys.executable, "podium"), ("raw Ray (numpy)", sys.executable, "raw")]
    if args.verl_python and os.path.exists(args.verl_python):
        contenders.insert(1, ("verl", args.verl_python, "verl"))
    # Rounds alternate the contenders so that a busy machine slows all of them alike.
    for i in range(args.rounds):
        order = contenders[i % len(contenders) :] + contenders[: i % len(contenders)]
        for name, python, part in order:
            runs.setdefault(name, []).append(_run_part(python, part, args.iters))
    results = {name: _median_of(r) for name, r in runs.items()}
    if "verl" not in results:
        results["verl"] = {
            "skipped": "skipped: pass --verl-python (or set VERL_PYTHON) to a venv with verl 0.9.1"
        }
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
