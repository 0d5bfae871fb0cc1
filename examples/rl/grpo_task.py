"""The GRPO trainer's task, loop and outputs, shared by ``grpo.py`` (podium) and ``grpo_plain.py``.

Task: given 5 random digits, output them reversed. Reward = fraction of positions right
(a uniform policy over the 16-token vocabulary scores 1/16). One step: prompts -> the
actor samples G completions per prompt -> rule-based reward -> group-normalized
advantages -> reference log-probs -> one AdamW step on the token-level policy-gradient
loss with a k3 KL penalty to the frozen reference.

``train`` only calls ``actor.generate``, ``ref.compute_log_prob``, ``actor.train_batch``,
``actor.save_checkpoint`` and ``actor.load_checkpoint``: podium worker groups in
``grpo.py``, in-process adapters in ``grpo_plain.py``. Everything that decides the
numbers -- prompts seeded by (seed, step), sampling seeded per sample, the split of the
batch -- is the same in both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from podium import DataProto
from podium.engines.fsdp import EngineConfig, LMConfig

N_DIGITS = 5
VOCAB = 16  # digits 0-9, BOS, SEP, four unused tokens
BOS, SEP = 10, 11
PROMPT_LEN = N_DIGITS + 2


def make_parser(description: str, *, with_backend: bool) -> argparse.ArgumentParser:
    # Flag names must not be prefixes of torchrun's own options (torchrun rejects them).
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    if with_backend:
        p.add_argument(
            "--backend",
            default=os.environ.get("PODIUM_BACKEND"),
            help="podium backend: ray, torchrun, ... (default: $PODIUM_BACKEND, else ray)",
        )
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size; dp = world size / tp")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/grpo"), help="output directory")
    p.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every K steps to OUT/ckpt/step_K"
    )
    p.add_argument(
        "--resume", type=Path, default=None, help="a checkpoint directory OUT/ckpt/step_K"
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (pinned)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--kl-coef", type=float, default=0.02)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--micro-batch", type=int, default=0, help="rows per micro-batch (0: the whole shard)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda: NCCL and bf16 on one GPU per rank; auto: cuda when torch sees a GPU",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write metrics.png")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.world_size < 1 or args.tp < 1 or args.world_size % args.tp:
        p.error(f"--tp {args.tp} must divide --world-size {args.world_size}")
    rows = args.prompts * args.group
    dp = args.world_size // args.tp
    if rows % dp:
        p.error(f"--prompts x --group = {rows} rows must divide by the DP size {dp}")
    if args.steps < 1 or args.group < 2:
        p.error("--steps must be >= 1 and --group >= 2 (advantages are normalized within a group)")
    if args.resume is not None and not (args.resume / "podium_engine.json").is_file():
        p.error(f"--resume {args.resume}: not a checkpoint directory (OUT/ckpt/step_K)")


def engine_configs(args: argparse.Namespace) -> tuple[EngineConfig, EngineConfig]:
    """The actor's and the frozen reference's configs (same seed: the reference is the initial actor)."""
    model = LMConfig(
        vocab_size=VOCAB,
        d_model=args.model_dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=PROMPT_LEN + N_DIGITS,
    )
    common: dict[str, Any] = dict(
        model=model,
        seed=args.seed,
        tp=args.tp,
        threads=args.threads,
        micro_batch_size=args.micro_batch or None,
        device=args.device,
    )
    actor = EngineConfig(**common, lr=args.lr, kl_coef=args.kl_coef)
    ref = EngineConfig(**common, trainable=False)
    return actor, ref


def use_gpu(args: argparse.Namespace) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def make_prompts(
    seed: int, step: int, n_prompts: int, group: int
) -> tuple[DataProto, torch.Tensor]:
    """The step's prompts, each repeated ``group`` times (rows of one prompt are adjacent)."""
    gen = torch.Generator().manual_seed(
        int(np.random.SeedSequence([seed, step]).generate_state(1)[0])
    )
    digits = torch.randint(0, 10, (n_prompts, N_DIGITS), generator=gen)
    prompts = torch.cat(
        [torch.full((n_prompts, 1), BOS), digits, torch.full((n_prompts, 1), SEP)], dim=1
    )
    prompts = prompts.repeat_interleave(group, dim=0)
    rows = prompts.shape[0]
    data = DataProto.from_dict({"prompts": prompts, "sample_index": torch.arange(rows)})
    return data, digits.repeat_interleave(group, dim=0)


def rewards(responses: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
    return (responses == digits.flip(1)).float().mean(dim=1)


def group_advantages(reward: torch.Tensor, group: int) -> torch.Tensor:
    r = reward.view(-1, group)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)
    return adv.reshape(-1)


class Role(Protocol):
    def generate(self, data: DataProto) -> DataProto: ...
    def compute_log_prob(self, data: DataProto) -> DataProto: ...
    def train_batch(self, data: DataProto) -> Any: ...
    def save_checkpoint(self, path: str) -> Any: ...
    def load_checkpoint(self, path: str) -> Any: ...


@dataclass
class Writer:
    """Metrics file, progress line and plot; only one process writes."""

    out: Path
    steps: int
    active: bool

    def open(self, start_step: int) -> None:
        if not self.active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "metrics.jsonl"
        kept: list[str] = []
        if start_step > 0 and path.exists():  # resuming into the same directory
            kept = [
                ln
                for ln in path.read_text().splitlines()
                if ln and json.loads(ln)["step"] <= start_step
            ]
        path.write_text("".join(ln + "\n" for ln in kept))

    def step(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        # json writes floats with repr(), which round-trips exactly: two files compare bit for bit.
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(
            f"step {record['step']:>4}/{self.steps}  reward {record['reward_mean']:.3f}  "
            f"loss {record['loss']:+.5f}  kl {record['kl']:.5f}  {record['step_s']:.2f} s  "
            f"{record['tokens_per_s']:,.0f} tok/s",
            flush=True,
        )

    def plot(self) -> None:
        if not self.active:
            return
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(
                "matplotlib is not installed: metrics.png not written (pip install 'podium[examples]')"
            )
            return
        records = [
            json.loads(ln) for ln in (self.out / "metrics.jsonl").read_text().splitlines() if ln
        ]
        steps = [r["step"] for r in records]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
        ax1.plot(steps, [r["reward_mean"] for r in records])
        ax1.set(xlabel="step", ylabel="mean reward", ylim=(0, 1), title="reward")
        ax2.plot(steps, [r["loss"] for r in records])
        ax2.set(xlabel="step", ylabel="loss", title="loss")
        fig.tight_layout()
        fig.savefig(self.out / "metrics.png", dpi=100)
        plt.close(fig)


def train(actor: Role, ref: Role, args: argparse.Namespace, writer: Writer) -> list[dict[str, Any]]:
    """Run steps ``start+1 .. args.steps``; return the per-step records."""
    start = 0
    if args.resume is not None:
        start = int(_first(actor.load_checkpoint(str(args.resume.resolve()))))
    writer.open(start)
    records = []
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        batch, digits = make_prompts(args.seed, step, args.prompts, args.group)
        batch.meta_info.update(step=step, max_new_tokens=N_DIGITS, temperature=args.temperature)
        gen = actor.generate(batch)
        batch = batch.union(gen)
        reward = rewards(gen.batch["responses"], digits)
        batch.batch["advantages"] = group_advantages(reward, args.group)
        ref_lp = ref.compute_log_prob(batch.select(["input_ids", "responses"]))
        batch.batch["ref_log_probs"] = ref_lp.batch["log_probs"]
        metrics = _first(
            actor.train_batch(
                batch.select(["input_ids", "responses", "advantages", "ref_log_probs"])
            )
        )
        step_s = time.perf_counter() - t0
        tokens = batch.batch["input_ids"].numel()
        record = {
            "step": step,
            "loss": metrics["loss"],
            "pg_loss": metrics["pg_loss"],
            "kl": metrics["kl"],
            "grad_norm": metrics["grad_norm"],
            "reward_mean": float(reward.mean()),
            "tokens_per_s": tokens / step_s,
            "step_s": step_s,
            "completions_sha256": hashlib.sha256(
                gen.batch["responses"].numpy().astype(np.int64).tobytes()
            ).hexdigest(),
        }
        if not all(math.isfinite(record[k]) for k in ("loss", "kl", "grad_norm")):
            raise FloatingPointError(f"step {step}: non-finite metrics {metrics}")
        records.append(record)
        writer.step(record)
        if args.save_every and step % args.save_every == 0:
            actor.save_checkpoint(str((args.out / "ckpt" / f"step_{step}").resolve()))
    writer.plot()
    return records


def _first(value: Any) -> Any:
    """One value from a per-replica (or per-rank) list of equal values."""
    return value[0] if isinstance(value, list) else value
