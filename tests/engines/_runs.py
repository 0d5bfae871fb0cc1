"""Running the GRPO trainer (``examples/rl``) as a user would: a subprocess per run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "examples" / "rl" / "grpo.py"
GRPO_PLAIN = ROOT / "examples" / "rl" / "grpo_plain.py"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # The engine pins threads itself: whatever a launcher sets must not matter.
    env.pop("OMP_NUM_THREADS", None)
    return env


def run_grpo(
    out: Path, *flags: str, backend: str | None = None, plain: bool = False, timeout: float = 240
) -> list[dict[str, Any]]:
    """Run ``grpo.py`` (or ``grpo_plain.py`` under torchrun) with ``--out out``; return its metrics records."""
    if plain:
        nproc = flags[flags.index("--world-size") + 1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            nproc,
            str(GRPO_PLAIN),
        ]
    else:
        cmd = [sys.executable, str(GRPO), "--backend", str(backend)]
    cmd += [*flags, "--out", str(out), "--no-plot"]
    proc = subprocess.run(
        cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def losses(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records]
