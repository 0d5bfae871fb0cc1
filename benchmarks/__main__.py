"""``python -m benchmarks``: run the schedule, write results.json, results.md and the plots.

Measures (``--only`` takes these or implementation names):

- ``latency``: a no-op ``ONE_TO_ALL`` call at 1, 2, 4 and 8 workers (median over at least
  200 calls and 1.5 s);
- ``data``: a ``DP_COMPUTE_PROTO`` round trip of a 1, 16, 64 and 256 MiB float32 batch over
  4 workers, each returning a new tensor of its shard's size (GiB/s of batch);
- ``ndmesh``: bytes the controller serializes for one dp=2 x tp=2 call, per batch byte;
- ``start``: from a fresh process to the first call of a 4-worker group returning;
- ``chain``: a batch through three groups, through the controller vs as ``BatchRef``;
- ``fsdp``: tokens/s of the GRPO trainer through podium on Ray and torchrun vs the plain
  torchrun script.

Implementations: podium-inline (the floor: no processes), podium-ray, podium-torchrun,
verl (0.9.1, under ``benchmarks/make-verl-venv.sh``'s venv; skipped with a note when
absent), raw-ray (numpy shards; raw-ray-torch: torch tensors), torchrun-plain (fsdp only),
and the machine: pipe (process-to-process round trip), zmq-curve (bare CURVE ROUTER to N
DEALERs) and memcpy (bandwidth; a shared-memory round trip needs three passes).

``--quick`` is the smoke run the test suite runs: tiny sizes, one repeat, no verl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat, no verl")
    parser.add_argument(
        "--only", nargs="+", default=[], metavar="NAME", help="measures or implementations"
    )
    parser.add_argument("--out", type=Path, default=harness.ROOT / "benchmarks" / "out")
    parser.add_argument(
        "--repeats", type=int, help="turns of every implementation (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--verl-python",
        type=Path,
        default=Path(os.environ.get("VERL_PYTHON", harness.DEFAULT_VERL_PYTHON)),
        help="interpreter of a venv with verl 0.9.1 (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout", type=float, help="seconds one turn may take (default 900; 600 with --quick)"
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: rewrite results.md and the plots from DIR/results.json",
    )
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads((args.out / "results.json").read_text())
        result["targets"] = report.check_targets(result["summary"])
        for path in report.write(result, args.out):
            print(f"wrote {path}")
        return 0
    sizes, turns, notes = harness.plan(args.only, args.quick, args.verl_python)
    repeats = args.repeats or (1 if args.quick else 3)
    run = harness.Run(sizes, repeats, turns, args.verl_python, notes=notes)
    started = datetime.datetime.now(datetime.timezone.utc)
    command = ["python", "-m", "benchmarks", *(argv if argv is not None else sys.argv[1:])]

    def write() -> list[Path]:
        return report.write(result_of(run, started, shlex.join(command)), args.out)

    harness.execute(run, timeout=args.timeout or (600 if args.quick else 900), after_repeat=write)
    for path in write():
        print(f"wrote {path}")
    print((args.out / "results.md").read_text())
    failed = [n for n in run.notes if "failed" in n]
    return 1 if failed else 0


def result_of(run: harness.Run, started: datetime.datetime, command: str) -> dict[str, Any]:
    summary = harness.summary(run)
    return {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "repeats": run.completed,
        "repeats_requested": run.repeats,
        "sizes": dict(vars(run.sizes)),
        "machine": harness.machine(),
        "load": [min(run.load, default=0.0), max(run.load, default=0.0)],
        "summary": summary,
        "targets": report.check_targets(summary),
        "notes": run.notes,
    }


if __name__ == "__main__":
    sys.exit(main())
