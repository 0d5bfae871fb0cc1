"""``python -m benchmarks --quick``: the benchmark harness runs end to end, so it cannot rot.

Tiny sizes, one repeat, no verl: every turn of the schedule must succeed and the report
must hold every measure of every implementation, the targets as ratios, and the plots.
The full run is not part of the suite (it takes tens of minutes). About a minute on an
idle 2-core machine; every turn is a fresh process whose workers import torch, so under
heavy load it takes several, hence the generous timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("ray", "torchx", "zmq", "matplotlib")),
        reason="the benchmarks need ray, torchx, pyzmq and matplotlib (podium[all,examples])",
    ),
]


@pytest.mark.timeout(900)
def test_quick_run_writes_every_measure_and_the_targets(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    summary = result["summary"]
    for impl in ("podium-inline", "podium-ray", "podium-torchrun", "raw-ray", "zmq-curve"):
        assert impl in summary["latency_ms@2"], impl
    for impl in (
        "podium-inline",
        "podium-ray",
        "podium-torchrun",
        "raw-ray",
        "raw-ray-torch",
        "memcpy",
    ):
        assert impl in summary["data_gib_s@1"], impl
    assert "pipe" in summary["latency_ms@1"]
    # One batch, not one per rank.
    assert summary["ndmesh_bytes_ratio"]["podium-torchrun"]["median"] <= 1.01
    for impl in ("podium-inline", "podium-ray", "podium-torchrun", "raw-ray"):
        assert impl in summary["start_s"], impl
    assert "podium-inline" in summary["chain_gb_s@batchref"]
    assert not [n for n in result["notes"] if "failed" in n]
    measured = {t["target"] for t in result["targets"] if t["ratio"] is not None}
    assert measured >= {
        "latency_ms@4: podium-torchrun / zmq-curve <= 1.5",
        "latency_ms@4: podium-ray / raw-ray <= 1.1",
        "data_gib_s@64: podium-torchrun / memcpy / 3 >= 0.6",
        "data_gib_s@64: podium-ray / raw-ray >= 0.9",
        "ndmesh_bytes_ratio: podium-torchrun <= 1.01",
    }
    assert "| target |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "latency.png").stat().st_size > 0
    assert (tmp_path / "data.png").stat().st_size > 0
