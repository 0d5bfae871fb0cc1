"""GRPO on "reverse 5 digits" as a plain torchrun script, without podium's controller.

    torchrun --nproc-per-node N examples/rl/grpo_plain.py --world-size N [--tp T]
        --steps K --seed S --out DIR [--save-every K] [--resume DIR/ckpt/step_K] [--threads T]

The same engine, task and loop as ``grpo.py``. What the controller does there -- split
a batch into one shard per DP replica, gather one output per replica, compute rewards
and advantages -- every rank does here for itself (all ranks hold the whole batch), so
the losses match ``grpo.py`` bit for bit and the difference in speed is podium's overhead.
Rank 0 writes the metrics.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist
from grpo_task import Writer, check_args, engine_configs, make_parser, train

from podium import DataProto
from podium.engines.fsdp import TrainingWorker


class LocalRole:
    """A ``TrainingWorker`` driven in-process: shard by DP rank, gather one output per replica."""

    def __init__(self, worker: TrainingWorker) -> None:
        self.worker = worker

    def _shard(self, data: DataProto) -> DataProto:
        engine = self.worker.engine
        return data.chunk(engine.dp_size)[engine.dp_rank]

    def _gather(self, out: DataProto) -> DataProto:
        engine = self.worker.engine
        parts: list[Any] = [None] * engine.dp_size
        dist.all_gather_object(parts, out, group=engine.dp_group)
        return DataProto.concat(parts)

    def generate(self, data: DataProto) -> DataProto:
        return self._gather(self.worker.generate(self._shard(data)))

    def compute_log_prob(self, data: DataProto) -> DataProto:
        return self._gather(self.worker.compute_log_prob(self._shard(data)))

    def train_batch(self, data: DataProto) -> dict[str, float]:
        return self.worker.train_batch(self._shard(data))

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> int:
        return self.worker.load_checkpoint(path)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__.split("\n\n")[0], with_backend=False)
    args = parser.parse_args(argv)
    check_args(parser, args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.world_size:
        parser.error(
            f"--world-size {args.world_size} but this process group has {world} ranks; "
            f"run: torchrun --nproc-per-node {args.world_size} {sys.argv[0]} ..."
        )
    try:
        actor_cfg, ref_cfg = engine_configs(args)
    except ValueError as exc:  # a model shape the engine rejects, before any process starts
        parser.error(str(exc))
    actor, ref = TrainingWorker(actor_cfg), TrainingWorker(ref_cfg)
    actor.init_model()
    ref.init_model()
    try:
        rank = dist.get_rank()
        if rank == 0:
            print(f"grpo_plain: {world} ranks (dp {world // args.tp} x tp {args.tp})", flush=True)
        train(
            LocalRole(actor), LocalRole(ref), args, Writer(args.out, args.steps, active=rank == 0)
        )
    finally:
        ref.shutdown()
        actor.shutdown()


if __name__ == "__main__":
    main()
