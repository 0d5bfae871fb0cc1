"""Helpers every implementation's child process shares; imports nothing of podium or verl.

A child measures one implementation once (one repeat) and returns flat metrics, named
``measure`` or ``measure@x`` (``latency_ms@4``: the no-op call latency at 4 workers).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20
ROW_BYTES = 64 * 1024  # float32 rows of 16384 columns: a batch of M MiB has 16 * M rows
COLS = ROW_BYTES // 4


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What one repeat measures; ``quick()`` is the smoke run's tiny version."""

    latency_workers: tuple[int, ...] = (1, 2, 4, 8)
    latency_calls: int = 200
    # ... and at least this long: on a small shared host a no-op call's latency swings by
    # ±30% over stretches of 0.2-1 s (both podium's and the bare fan-out's), so a sample of
    # 200 calls of 0.2-0.4 ms caught one stretch, and a repeat's figure was its luck.
    latency_seconds: float = 1.5
    data_workers: int = 4
    data_mib: tuple[int, ...] = (1, 16, 64, 256)
    ndmesh_mib: int = 16
    chain_mib: int = 256  # the data-plane measure: a 256 MiB batch
    chain_rounds: int = 7
    fsdp_world_size: int = 2
    # 12 timed steps: with 4, one slow step on a shared machine moved a run's figure by 10%.
    fsdp_steps: int = 14
    fsdp_warmup: int = 2
    fsdp_model: tuple[str, ...] = ("--layers", "4", "--model-dim", "192", "--heads", "6")
    measures: tuple[str, ...] = field(default=())

    @staticmethod
    def quick(measures: tuple[str, ...] = ()) -> Sizes:
        return Sizes(
            latency_workers=(2,),
            data_workers=2,
            latency_calls=20,
            latency_seconds=0.0,
            data_mib=(1,),
            ndmesh_mib=1,
            chain_mib=1,
            chain_rounds=1,
            fsdp_steps=2,
            fsdp_warmup=1,
            fsdp_model=("--layers", "1", "--model-dim", "32", "--heads", "2"),
            measures=measures,
        )

    def trips(self, mib: int) -> int:
        """Round trips timed for a batch of ``mib`` MiB: more for small batches, at least 3."""
        return max(3, min(20, 256 // max(mib, 1)))

    def wants(self, measure: str) -> bool:
        return not self.measures or measure in self.measures


def progress(what: str) -> None:
    """One line on stderr per phase, so a slow or stuck turn shows where it is."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any], n: int, warmup: int = 1, at_least: float = 0.0) -> float:
    """The median wall time of ``n`` calls of ``fn`` after ``warmup`` untimed ones, in seconds;
    more calls than ``n`` where those took less than ``at_least`` seconds."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    until = time.perf_counter() + at_least
    while len(samples) < n or time.perf_counter() < until:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def latency_ms(fn: Callable[[], Any], sizes: Sizes) -> float:
    """The no-op call latency every implementation reports: the median over
    ``sizes.latency_calls`` calls and ``sizes.latency_seconds``, after 20 warm-up calls."""
    return timed(fn, sizes.latency_calls, 20, sizes.latency_seconds) * 1e3


def gib_s(mib: int, seconds: float) -> float:
    return mib / 1024 / seconds
