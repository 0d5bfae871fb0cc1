"""The schedule: every implementation once per repeat, in turn (A B C A B C ...).

Each turn is a fresh process, so every implementation starts cold every time and none
inherits another's warm caches, threads or Ray instance; the order rotates by one each
repeat, so that a machine whose load drifts slows every implementation alike. A turn
returns one sample of each of its metrics; the report shows the median and the min/max
over the repeats.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import grpo
from benchmarks._common import Sizes

ROOT = Path(__file__).resolve().parents[1]
MEASURES = ("latency", "data", "ndmesh", "start", "chain", "fsdp")
# What --quick leaves out, to stay a smoke run: every extra group costs a start (seconds of
# imports per worker), and the test suite covers these paths on its own.
QUICK_SKIPS = {
    "podium-ray": ("ndmesh", "chain"),
    "podium-torchrun": ("chain",),
    "fsdp:plain": ("fsdp",),
    "fsdp:ray": ("fsdp",),
    "fsdp:torchrun": ("fsdp",),
}
DEFAULT_VERL_PYTHON = ROOT / "benchmarks" / ".verl-venv" / "bin" / "python"


@dataclass(frozen=True)
class Turn:
    """One process of the schedule: ``kind`` is ``child`` (benchmarks._child) or ``fsdp``."""

    name: str
    kind: str
    measures: tuple[str, ...]
    impl: str  # the implementation its samples belong to


TURNS = (
    Turn(
        "podium-inline", "child", ("latency", "data", "ndmesh", "start", "chain"), "podium-inline"
    ),
    Turn("podium-ray", "child", ("latency", "data", "ndmesh", "start", "chain"), "podium-ray"),
    Turn(
        "podium-torchrun",
        "child",
        ("latency", "data", "ndmesh", "start", "chain"),
        "podium-torchrun",
    ),
    Turn("verl", "child", ("latency", "data", "ndmesh", "start"), "verl"),
    Turn("raw-ray", "child", ("latency", "data", "start"), "raw-ray"),
    Turn("machine", "child", ("latency", "data"), "machine"),
    Turn("fsdp:plain", "fsdp", ("fsdp",), "torchrun-plain"),
    Turn("fsdp:ray", "fsdp", ("fsdp",), "podium-ray"),
    Turn("fsdp:torchrun", "fsdp", ("fsdp",), "podium-torchrun"),
)
IMPLEMENTATIONS = (
    "podium-inline",
    "podium-ray",
    "podium-torchrun",
    "verl",
    "raw-ray",
    "raw-ray-torch",
    "torchrun-plain",
    "pipe",
    "zmq-curve",
    "memcpy",
)


@dataclass
class Run:
    sizes: Sizes
    repeats: int
    turns: list[Turn]
    verl_python: Path | None
    samples: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    losses: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    load: list[float] = dataclasses.field(default_factory=list)
    completed: int = 0  # repeats finished

    def add(self, impl: str, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            owner, _, metric = key.rpartition(":")
            self.samples.setdefault(metric, {}).setdefault(owner or impl, []).append(value)


def plan(
    only: list[str], quick: bool, verl_python: Path | None
) -> tuple[Sizes, list[Turn], list[str]]:
    """The sizes and turns for ``--only`` (measure or implementation names) and ``--quick``."""
    unknown = set(only) - set(MEASURES) - {t.name for t in TURNS} - set(IMPLEMENTATIONS)
    if unknown:
        raise SystemExit(
            f"--only: unknown {sorted(unknown)}; measures: {', '.join(MEASURES)}; "
            f"implementations: {', '.join(IMPLEMENTATIONS)}"
        )
    measures = tuple(m for m in MEASURES if m in only) or MEASURES
    # Implementations measured in another's turn (the machine's limits, raw Ray with torch).
    measured_in = {"pipe": "machine", "zmq-curve": "machine", "memcpy": "machine"}
    measured_in["raw-ray-torch"] = "raw-ray"
    impls = {measured_in.get(n, n) for n in only if n not in MEASURES}
    sizes = Sizes.quick(measures) if quick else Sizes(measures=measures)
    notes = []
    if quick:
        notes.append(
            "--quick: tiny sizes, one repeat; no verl, no FSDP, no chain on ray/torchrun, "
            "no nd-mesh on ray"
        )
    turns = []
    for turn in TURNS:
        if impls and turn.name not in impls and turn.impl not in impls:
            continue
        if quick and turn.name in QUICK_SKIPS:
            turn = dataclasses.replace(
                turn, measures=tuple(m for m in turn.measures if m not in QUICK_SKIPS[turn.name])
            )
        if not set(turn.measures) & set(measures):
            continue
        if turn.name == "verl":
            if quick:
                continue
            if verl_python is None or not verl_python.exists():
                notes.append(
                    f"verl: skipped, no interpreter at {verl_python}: "
                    "run `bash benchmarks/make-verl-venv.sh` (or pass --verl-python)"
                )
                continue
        turns.append(turn)
    return sizes, turns, notes


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_")}
    env["PYTHONPATH"] = str(ROOT)
    # Ray starts its workers at niceness 15; podium's local Ray runs them at 0. Every Ray
    # here gets the same, so that the comparison is of the frameworks, not of priorities.
    env.setdefault("RAY_worker_niceness", "0")
    return env


def _child(run: Run, turn: Turn, timeout: float) -> dict[str, float]:
    python = str(run.verl_python) if turn.name == "verl" else sys.executable
    sizes = {k: v for k, v in dataclasses.asdict(run.sizes).items()}
    sizes["measures"] = [m for m in run.sizes.measures if m in turn.measures]
    proc = subprocess.run(
        [python, "-m", "benchmarks._child", turn.name, json.dumps(sizes)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=timeout,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")


def _fsdp(run: Run, turn: Turn, timeout: float) -> dict[str, float]:
    launcher = turn.name.removeprefix("fsdp:")
    s = run.sizes
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        got = grpo.run(
            launcher,
            Path(tmp),
            world_size=s.fsdp_world_size,
            steps=s.fsdp_steps,
            warmup=s.fsdp_warmup,
            model=s.fsdp_model,
            env=_env(),
            timeout=timeout,
        )
    run.losses.setdefault(turn.impl, got["losses"])
    return {
        "fsdp_tokens_s": got["tokens_s"],
        "fsdp_fastest_step_tokens_s": got["fastest_step_tokens_s"],
    }


def execute(
    run: Run,
    *,
    timeout: float,
    log: Callable[[str], None] = print,
    after_repeat: Callable[[], object] = lambda: None,
) -> None:
    """Run the schedule, adding each turn's samples to ``run``; a failed turn is a note.
    ``after_repeat`` runs after every repeat (the report so far: a long run stopped early
    still leaves its results)."""
    for r in range(run.repeats):
        k = r % max(len(run.turns), 1)
        for turn in run.turns[k:] + run.turns[:k]:
            run.load.append(os.getloadavg()[0])
            t = time.perf_counter()
            try:
                metrics = (_fsdp if turn.kind == "fsdp" else _child)(run, turn, timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                run.notes.append(f"{turn.name} (repeat {r + 1}) failed: {exc}")
                log(f"repeat {r + 1}/{run.repeats} {turn.name:16} FAILED: {str(exc)[-300:]}")
                continue
            run.add(turn.impl, metrics)
            log(f"repeat {r + 1}/{run.repeats} {turn.name:16} {time.perf_counter() - t:6.1f} s")
        run.completed = r + 1
        if r + 1 < run.repeats:
            after_repeat()
    run.load.append(os.getloadavg()[0])
    if len({tuple(v) for v in run.losses.values()}) > 1:
        run.notes.append(
            "FSDP: the launchers' per-step losses differ (they should be bit-identical)"
        )
    elif len(run.losses) > 1:
        run.notes.append("FSDP: per-step losses bit-identical across launchers")


def summary(run: Run) -> dict[str, dict[str, dict[str, float]]]:
    """metric -> implementation -> median, min, max, n over the repeats."""
    return {
        metric: {
            impl: {
                "median": statistics.median(v),
                "min": min(v),
                "max": max(v),
                "n": len(v),
            }
            for impl, v in by_impl.items()
        }
        for metric, by_impl in sorted(run.samples.items())
    }


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
