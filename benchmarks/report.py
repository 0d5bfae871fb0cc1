"""results.json, results.md and the plots, from a finished run; the targets as ratios."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Summary = dict[str, dict[str, dict[str, float]]]

TITLES = {
    "latency_ms": ("No-op `ONE_TO_ALL` call, ms (lower is better)", "workers"),
    "data_gib_s": (
        "`DP_COMPUTE_PROTO` round trip, GiB/s of batch (4 workers; 2 with --quick)",
        "MiB",
    ),
    "start_s": ("Group start, cold: nothing to the first call returning, s (4 workers)", ""),
    "ndmesh_bytes_ratio": ("nd-mesh dp=2 x tp=2: bytes serialized per call / batch bytes", ""),
    "chain_gb_s": ("Chain A(2) -> B(3) -> C(2) of a 256 MiB batch (1 MiB with --quick), payload GB/s, via", ""),
    "chain_controller_bytes_pct": (
        "Chain: controller bytes for a `BatchRef` call, % of payload",
        "",
    ),
    "fsdp_tokens_s": ("GRPO trainer (FSDP, 2 ranks): tokens/s", ""),
    "fsdp_fastest_step_tokens_s": ("GRPO trainer: tokens/s of the fastest step", ""),
}


@dataclass(frozen=True)
class Target:
    """``impl``'s ``metric`` divided by ``versus``'s must be <= (or >=) ``bound``."""

    metric: str
    impl: str
    versus: str
    op: str
    bound: float
    scale: float = 1.0  # multiplies the denominator (memcpy / 3: scale 1/3)

    def label(self) -> str:
        if not self.versus:
            return f"{self.metric}: {self.impl} {self.op} {self.bound:g}"
        versus = self.versus if self.scale == 1.0 else f"{self.versus} / {round(1 / self.scale)}"
        return f"{self.metric}: {self.impl} / {versus} {self.op} {self.bound:g}"


LATENCY, DATA = "latency_ms@4", "data_gib_s@64"
TARGETS = (
    Target(LATENCY, "podium-torchrun", "zmq-curve", "<=", 1.5),
    Target(LATENCY, "podium-torchrun", "verl", "<=", 0.2),
    Target(LATENCY, "podium-ray", "verl", "<=", 1.0),
    Target(LATENCY, "podium-ray", "raw-ray", "<=", 1.1),
    Target(DATA, "podium-torchrun", "memcpy", ">=", 0.6, scale=1 / 3),
    Target(DATA, "podium-torchrun", "verl", ">=", 8.0),
    Target(DATA, "podium-ray", "verl", ">=", 2.5),
    Target(DATA, "podium-ray", "raw-ray", ">=", 0.9),
    Target("start_s", "podium-torchrun", "verl", "<=", 0.5),
    Target("start_s", "podium-ray", "verl", "<=", 1.0),
    Target("ndmesh_bytes_ratio", "podium-torchrun", "", "<=", 1.01),
    Target("ndmesh_bytes_ratio", "podium-ray", "", "<=", 1.01),
    Target("fsdp_tokens_s", "podium-ray", "torchrun-plain", ">=", 0.95),
    Target("fsdp_tokens_s", "podium-torchrun", "torchrun-plain", ">=", 0.95),
)


def _fallback(metric: str, summary: Summary) -> str:
    """A target's metric, or (a quick run has no 64 MiB batch) the largest size measured."""
    if metric in summary or "@" not in metric:
        return metric
    base = metric.split("@")[0]
    sizes = sorted(int(m.split("@")[1]) for m in summary if m.startswith(base + "@"))
    return f"{base}@{sizes[-1]}" if sizes else metric


def _ratio(t: Target, by_impl: dict[str, dict[str, float]], stat: str) -> float:
    den = by_impl[t.versus][stat] * t.scale if t.versus else 1.0
    return by_impl[t.impl][stat] / den


def check_targets(summary: Summary) -> list[dict[str, Any]]:
    out = []
    for t in TARGETS:
        metric = _fallback(t.metric, summary)
        row: dict[str, Any] = {"target": t.label(), "metric": metric, "ratio": None, "met": None}
        row["substituted"] = metric != t.metric
        by_impl = summary.get(metric, {})
        if t.impl not in by_impl or (t.versus and t.versus not in by_impl):
            row["status"] = "not measured"
        else:
            # The median over the repeats decides; the ratio of the best repeats (the
            # fastest of each) is shown beside it, since load on a shared machine only
            # ever slows a turn down.
            best = "min" if t.op == "<=" else "max"
            ratio = _ratio(t, by_impl, "median")
            met = _holds(ratio, t.op, t.bound)
            row.update(
                ratio=ratio,
                ratio_best=_ratio(t, by_impl, best),
                met=met,
                status="met" if met else "MISSED",
            )
        out.append(row)
    return out


def _holds(x: float, op: str, bound: float) -> bool:
    return x <= bound if op == "<=" else x >= bound


def ratio_text(ratio: float, op: str, bound: float) -> str:
    """``ratio`` to three digits, or as many more as it takes to read on its side of ``bound``.

    (1.0006 against ``<= 1`` prints as ``1.001``, not as a ``1`` marked MISSED.)
    """
    for digits in range(3, 8):
        text = f"{ratio:.{digits}g}"
        if _holds(float(text), op, bound) == _holds(ratio, op, bound):
            return text
    return repr(ratio)


def _cell(s: dict[str, float]) -> str:
    def f(x: float) -> str:
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"

    if s["n"] == 1:
        return f(s["median"])
    return f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})"


def _order(impls: Any) -> list[str]:
    from benchmarks.harness import IMPLEMENTATIONS

    return sorted(
        impls, key=lambda i: (IMPLEMENTATIONS.index(i) if i in IMPLEMENTATIONS else 99, i)
    )


def _split(metric: str) -> tuple[str, str]:
    base, _, x = metric.partition("@")
    return base, x


def tables(summary: Summary) -> str:
    groups: dict[str, list[str]] = {base: [] for base in TITLES}
    for metric in summary:
        groups.setdefault(_split(metric)[0], []).append(metric)
    parts = []
    for base, metrics in groups.items():
        if not metrics:
            continue
        title, xname = TITLES.get(base, (base, ""))
        metrics.sort(key=lambda m: int(_split(m)[1]) if _split(m)[1].isdigit() else _split(m)[1])
        impls = _order({i for m in metrics for i in summary[m]})
        heads = [f"{_split(m)[1]} {xname}".strip() or "value" for m in metrics]
        lines = [
            f"**{title}**",
            "",
            "| | " + " | ".join(heads) + " |",
            "|---" * (len(heads) + 1) + "|",
        ]
        for impl in impls:
            cells = [_cell(summary[m][impl]) if impl in summary[m] else "" for m in metrics]
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def markdown(result: dict[str, Any]) -> str:
    targets = result["targets"]
    lines = [
        f"Run {result['date']} with `{result['command']}`: {result['repeats']} of "
        f"{result.get('repeats_requested', result['repeats'])} repeat(s) done, "
        f"median (min-max); {result['machine']['cpus']} CPUs, load average "
        f"{result['load'][0]:.1f}-{result['load'][1]:.1f} during the run.",
        "",
        "| target | ratio of medians | of best repeats | |",
        "|---|---|---|---|",
    ]
    bounds = {t.label(): (t.op, t.bound) for t in TARGETS}
    for t in targets:
        op, bound = bounds[t["target"]]
        ratio = "-" if t["ratio"] is None else ratio_text(t["ratio"], op, bound)
        best = "-" if t.get("ratio_best") is None else ratio_text(t["ratio_best"], op, bound)
        where = f" (at {t['metric']})" if t["substituted"] else ""
        lines.append(f"| {t['target']}{where} | {ratio} | {best} | {t['status']} |")
    lines += ["", tables(result["summary"])]
    if result["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plots(summary: Summary, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    series = [
        ("latency_ms", "workers", "ms per no-op call", "latency.png", True),
        ("data_gib_s", "batch MiB (4 workers)", "GiB/s round trip", "data.png", True),
    ]
    for base, xlabel, ylabel, name, logy in series:
        metrics = [m for m in summary if _split(m)[0] == base]
        if not metrics:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=90)
        for impl in _order({i for m in metrics for i in summary[m]}):
            pts = sorted(
                (int(_split(m)[1]), summary[m][impl]) for m in metrics if impl in summary[m]
            )
            xs = [x for x, _ in pts]
            med = [s["median"] for _, s in pts]
            err = [
                [s["median"] - s["min"] for _, s in pts],
                [s["max"] - s["median"] for _, s in pts],
            ]
            label = impl
            if base == "data_gib_s" and impl == "memcpy":
                med = [m / 3 for m in med]
                err = [[e / 3 for e in err[0]], [e / 3 for e in err[1]]]
                label = "memcpy / 3 (bound)"
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=2, label=label)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        written.append(out / name)
    bars: list[tuple[str, str]] = [
        (m, TITLES[m][0]) for m in ("start_s", "fsdp_tokens_s") if m in summary
    ]
    bars += [
        (m, f"chain via {_split(m)[1]}, GB/s") for m in summary if _split(m)[0] == "chain_gb_s"
    ]
    if bars:
        fig, axes = plt.subplots(1, len(bars), figsize=(2.6 * len(bars) + 0.6, 3.2), dpi=90)
        for ax, (metric, title) in zip(getattr(axes, "flat", [axes]), bars):
            impls = _order(summary[metric])
            med = [summary[metric][i]["median"] for i in impls]
            ax.bar(range(len(impls)), med)
            ax.set_xticks(range(len(impls)), impls, rotation=40, ha="right", fontsize=7)
            ax.set_title(re.sub(r"`|\(.*?\)", "", title).strip(), fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "summary.png")
        plt.close(fig)
        written.append(out / "summary.png")
    return written


def write(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(markdown(result))
    return [out / "results.json", out / "results.md", *plots(result["summary"], out)]
