"""podium's torchrun backend vs verl 0.9.1's RayWorkerGroup, side by side on the same work.

Four CPU workers each. Measured for both:

- **start**: from nothing (no Ray, no processes) to the first call returning
  -- pool, workers, and for verl ``ray.init``;
- **no-op ONE_TO_ALL**: the median latency of a call that does nothing;
- **DP_COMPUTE_PROTO 64 MiB**: a float32 batch of 64 MiB split over the four
  workers, each returns a new tensor of the same size (``x * 2``), gathered
  back; throughput is batch bytes / round-trip time (median).

verl runs in a subprocess under its own interpreter (``--verl-python`` or
``$VERL_PYTHON``, default ``/tmp/verl-venv/bin/python``); without it the verl
column is skipped with a note. This file imports nothing of podium at module
level so that the verl interpreter can run it too.

    .venv/bin/python benchmarks/bench_torchrun.py [--calls 300] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from typing import Any

ROWS, COLS = 1024, 16384  # float32: 64 MiB
WORLD = 4


def _batch() -> Any:
    import torch

    return torch.randn(ROWS, COLS)


def _timed_calls(fn: Any, n: int) -> float:
    for _ in range(min(20, n)):
        fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


# -- podium ------------------------------------------------------------------------


def run_podium(calls: int, rounds: int) -> dict[str, float]:
    t0 = time.perf_counter()
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
        def double(self, data: DataProto) -> DataProto:
            return DataProto.from_dict({"y": data.batch["x"] * 2})

    wg = WorkerGroup(
        ResourcePool([WORLD], use_gpu=False), ClassWithInitArgs(BenchWorker), backend="torchrun"
    )
    try:
        wg.noop()
        start = time.perf_counter() - t0
        noop = _timed_calls(wg.noop, calls)
        data = DataProto.from_dict({"x": _batch()})
        out = wg.double(data)
        if not bool((out.batch["y"] == data.batch["x"] * 2).all()):
            raise RuntimeError("podium returned a wrong result")
        del out
        rt = _timed_calls(lambda: wg.double(data), rounds)
    finally:
        wg.shutdown()
    return {
        "start_s": start,
        "noop_ms": noop * 1e3,
        "dp64_s": rt,
        "dp64_gib_s": (ROWS * COLS * 4 / 2**30) / rt,
    }


# -- verl (run under verl's interpreter) ----------------------------------------


def run_verl(calls: int, rounds: int) -> dict[str, float]:
    t0 = time.perf_counter()
    import ray
    from verl import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    class BenchWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def noop(self) -> None:
            return None

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def double(self, data: DataProto) -> DataProto:
            return DataProto.from_dict({"y": data.batch["x"] * 2})

    ray.init(num_cpus=2 * WORLD, include_dashboard=False, log_to_driver=False)
    try:
        pool = RayResourcePool([WORLD], use_gpu=False, max_colocate_count=1)
        wg = RayWorkerGroup(
            pool, RayClassWithInitArgs(cls=ray.remote(BenchWorker)), device_name="cpu"
        )
        wg.noop()
        start = time.perf_counter() - t0
        noop = _timed_calls(wg.noop, calls)
        data = DataProto.from_dict({"x": _batch()})
        wg.double(data)
        rt = _timed_calls(lambda: wg.double(data), rounds)
    finally:
        ray.shutdown()
    return {
        "start_s": start,
        "noop_ms": noop * 1e3,
        "dp64_s": rt,
        "dp64_gib_s": (ROWS * COLS * 4 / 2**30) / rt,
    }


def _verl_subprocess(python: str, calls: int, rounds: int) -> dict[str, float] | str:
    if not os.path.exists(python):
        return f"verl interpreter {python} not found; set --verl-python or $VERL_PYTHON to compare"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODIUM_", "PYTHONPATH"))}
    proc = subprocess.run(
        [
            python,
            os.path.abspath(__file__),
            "--verl-child",
            "--calls",
            str(calls),
            "--rounds",
            str(rounds),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("VERL_RESULT "):
            return json.loads(line[len("VERL_RESULT ") :])
    return f"verl run failed (exit {proc.returncode}): {proc.stderr[-2000:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="no-op calls timed")
    parser.add_argument("--rounds", type=int, default=10, help="64 MiB round trips timed")
    parser.add_argument(
        "--verl-python", default=os.environ.get("VERL_PYTHON", "/tmp/verl-venv/bin/python")
    )
    parser.add_argument("--skip-verl", action="store_true")
    parser.add_argument("--verl-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.verl_child:
        print("VERL_RESULT " + json.dumps(run_verl(args.calls, args.rounds)), flush=True)
        return
    verl: dict[str, float] | str = "skipped (--skip-verl)"
    if not args.skip_verl:
        verl = _verl_subprocess(args.verl_python, args.calls, args.rounds)
    podium = run_podium(args.calls, args.rounds)
    rows = [
        ("group start (s)", "start_s", "{:.2f}", "lower"),
        ("no-op ONE_TO_ALL (ms)", "noop_ms", "{:.3f}", "lower"),
        ("DP_COMPUTE_PROTO 64 MiB round trip (s)", "dp64_s", "{:.4f}", "lower"),
        ("DP_COMPUTE_PROTO 64 MiB (GiB/s)", "dp64_gib_s", "{:.2f}", "higher"),
    ]
    print(f"{'metric':42s} {'podium torchrun':>16s} {'verl 0.9.1 ray':>16s} {'podium/verl':>12s}")
    for label, key, fmt, _better in rows:
        p = fmt.format(podium[key])
        if isinstance(verl, dict):
            v = fmt.format(verl[key])
            ratio = f"{podium[key] / verl[key]:.3f}x"
        else:
            v, ratio = "-", "-"
        print(f"{label:42s} {p:>16s} {v:>16s} {ratio:>12s}")
    if not isinstance(verl, dict):
        print(f"note: verl column skipped: {verl}")
    print("JSON " + json.dumps({"podium": podium, "verl": verl}))


if __name__ == "__main__":
    main()
