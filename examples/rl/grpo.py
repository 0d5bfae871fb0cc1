"""GRPO on "reverse 5 digits" with podium: the same trainer on every backend.

    python examples/rl/grpo.py --backend {ray,torchrun,...} --world-size N [--tp T]
        --steps K --seed S --out DIR [--save-every K] [--resume DIR/ckpt/step_K] [--threads T]

Actor and frozen reference are two roles colocated in one process per rank
(``create_colocated_worker_cls`` + ``spawn``), each an FSDP2 ``TrainingWorker``. Writes
DIR/metrics.jsonl (one exact JSON record per step) and DIR/metrics.png. Nothing here
depends on the backend: the same seed gives the same losses, bit for bit, on Ray, on
torchrun, and with the controller-less ``grpo_plain.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_task import Writer, check_args, engine_configs, make_parser, train, use_gpu

from podium import ClassWithInitArgs, ResourcePool, WorkerGroup, create_colocated_worker_cls
from podium.engines.fsdp import TrainingWorker


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__.split("\n\n")[0], with_backend=True)
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        actor_cfg, ref_cfg = engine_configs(args)
    except ValueError as exc:  # a model shape the engine rejects, before any process starts
        parser.error(str(exc))
    roles = create_colocated_worker_cls(
        {
            "actor": ClassWithInitArgs(TrainingWorker, actor_cfg),
            "ref": ClassWithInitArgs(TrainingWorker, ref_cfg),
        }
    )
    pool = ResourcePool([args.world_size], use_gpu=use_gpu(args))
    with WorkerGroup(pool, roles, backend=args.backend, name_prefix="grpo") as wg:
        views = wg.spawn(["actor", "ref"])
        actor, ref = views["actor"], views["ref"]
        actor.init_model()
        ref.init_model()
        print(
            f"grpo: backend {wg.backend}, {args.world_size} ranks (dp {args.world_size // args.tp} x tp {args.tp})",
            flush=True,
        )
        train(actor, ref, args, Writer(args.out, args.steps, active=True))


if __name__ == "__main__":
    main()
