"""The benchmark report without running anything: targets as ratios, the tables, the plan,
and how a sample is timed."""

from __future__ import annotations

import importlib.util
import time

import pytest

from benchmarks import harness, report
from benchmarks._common import timed


def _stat(*values: float) -> dict[str, float]:
    return {
        "median": sorted(values)[len(values) // 2],
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


SUMMARY = {
    "latency_ms@4": {"podium-torchrun": _stat(0.3, 0.4, 0.9), "zmq-curve": _stat(0.25, 0.2, 0.3)},
    "data_gib_s@1": {"podium-ray": _stat(1.0, 2.0), "raw-ray": _stat(2.0, 2.0)},
}


def _target(rows: list[dict], label: str) -> dict:
    return next(r for r in rows if r["target"] == label)


def test_targets_are_ratios_of_medians_with_the_best_repeats_beside() -> None:
    rows = report.check_targets(SUMMARY)
    lat = _target(rows, "latency_ms@4: podium-torchrun / zmq-curve <= 1.5")
    assert lat["ratio"] == pytest.approx(0.4 / 0.25)
    assert lat["status"] == "MISSED"
    assert lat["ratio_best"] == pytest.approx(0.3 / 0.2)  # lower is better: min / min
    # A run without 64 MiB checks the largest size it measured, and says so.
    data = _target(rows, "data_gib_s@64: podium-ray / raw-ray >= 0.9")
    assert data["metric"] == "data_gib_s@1" and data["substituted"]
    assert data["ratio_best"] == pytest.approx(1.0)  # higher is better: max / max
    assert _target(rows, "start_s: podium-ray / verl <= 1")["status"] == "not measured"


def _markdown(summary: dict, repeats: int, notes: list[str]) -> str:
    return report.markdown(
        {
            "date": "today",
            "command": "python -m benchmarks",
            "repeats": repeats,
            "machine": {"cpus": 2},
            "load": [1.0, 2.0],
            "summary": summary,
            "targets": report.check_targets(summary),
            "notes": notes,
        }
    )


def test_markdown_has_the_targets_and_a_table_per_measure() -> None:
    text = _markdown(SUMMARY, 3, ["a note"])
    assert "3 of 3 repeat(s)" in text
    assert "| podium-torchrun | 0.4 (0.3-0.9) |" in text
    assert "- a note" in text


def test_a_ratio_next_to_its_bound_shows_the_digits_that_decide_it() -> None:
    # 1.0006 against "<= 1" would print as "1" beside MISSED at three digits.
    summary = {"latency_ms@4": {"podium-ray": _stat(1.0006, 0.9), "verl": _stat(1.0, 1.0)}}
    text = _markdown(summary, 2, [])
    assert "| latency_ms@4: podium-ray / verl <= 1 | 1.001 | 0.9 | MISSED |" in text
    assert report.ratio_text(0.99996, "<=", 1.0) == "1"  # met, and "1 <= 1" says so
    assert report.ratio_text(0.9496, ">=", 0.95) == "0.9496"
    assert report.ratio_text(1.62, "<=", 1.5) == "1.62"


def test_plan_skips_verl_without_its_interpreter_and_rejects_unknown_names(tmp_path) -> None:
    _, turns, notes = harness.plan([], False, tmp_path / "missing" / "python")
    assert "verl" not in [t.name for t in turns]
    assert any("make-verl-venv.sh" in n for n in notes)
    with pytest.raises(SystemExit, match="unknown"):
        harness.plan(["no-such-thing"], False, None)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plots_are_written(tmp_path) -> None:
    written = report.plots(SUMMARY, tmp_path)
    assert {p.name for p in written} == {"latency.png", "data.png"}


def test_a_timed_sample_spans_its_minimum_time_not_just_its_calls() -> None:
    calls = []

    def call() -> None:
        calls.append(None)
        time.sleep(0.001)

    timed(call, 3, warmup=2)
    assert len(calls) == 5  # the warm-up and n calls: no window asked for
    calls.clear()
    start = time.perf_counter()
    median = timed(call, 3, warmup=2, at_least=0.1)
    assert time.perf_counter() - start >= 0.1
    assert len(calls) > 20  # ~1 ms calls for 0.1 s, not 3
    assert 0.001 <= median < 0.1
