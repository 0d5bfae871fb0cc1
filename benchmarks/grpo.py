"""FSDP: tokens/s of the GRPO trainer through podium (each backend) vs the plain torchrun script.

The same engine, task, seed and model on the same world size: ``examples/rl/grpo.py``
with ``--backend ray`` and ``--backend torchrun`` against ``examples/rl/grpo_plain.py``
under ``torchrun --standalone`` (no controller). The full run's model is larger than the
trainer's default (4 layers, d_model 192: ~1.8M parameters) so that one step takes over a
second on a small CPU machine and the controller's per-step cost is measured against real
work. ``python -m benchmarks`` runs the launchers in its interleaved schedule (the ``fsdp``
measure); the losses of all runs must be bit-identical.

Tokens/s of a run = sequence tokens / step time, summed over the steps after the warmup.
A second figure uses the run's fastest step: on a machine shared with other jobs,
background load only ever slows a step down, so the fastest step is the best estimate of
the unloaded speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ("plain", "ray", "torchrun")
__all__ = ["LAUNCHERS", "run"]


def _command(launcher: str, flags: list[str]) -> list[str]:
    if launcher == "plain":
        nproc = flags[flags.index("--world-size") + 1]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            nproc,
            str(ROOT / "examples/rl/grpo_plain.py"),
            *flags,
        ]
    return [sys.executable, str(ROOT / "examples/rl/grpo.py"), "--backend", launcher, *flags]


def run(
    launcher: str,
    out: Path,
    *,
    world_size: int,
    steps: int,
    warmup: int,
    model: tuple[str, ...],
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> dict[str, Any]:
    """Train once with ``launcher`` (``plain``, ``ray`` or ``torchrun``); return its figures."""
    flags = ["--world-size", str(world_size), "--steps", str(steps), "--seed", "0"]
    flags += [*model, "--out", str(out), "--no-plot"]
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        _command(launcher, flags),
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"GRPO with {launcher} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
    timed = records[warmup:] or records
    seconds = sum(r["step_s"] for r in timed)
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in timed)
    return {
        "tokens_s": tokens / seconds,
        "fastest_step_tokens_s": max(r["tokens_per_s"] for r in timed),
        "losses": [r["loss"] for r in records],
    }
