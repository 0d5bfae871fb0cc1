"""Four workers score a batch: the batch of 8 is split over 4 ranks, each adds
its rank, and the results come back in order.

    python examples/quickstart.py                      # Ray: a local cluster is started for you
    python examples/quickstart.py --backend torchrun   # torchrun workers launched through torchx
    python examples/quickstart.py --backend inline     # every rank in this process (debugging)
"""

from __future__ import annotations

import argparse
import time

import torch

from podium import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)


class Scorer(Worker):
    def __init__(self, bonus: float) -> None:
        super().__init__()
        self.bonus = bonus

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, batch: DataProto) -> DataProto:
        scores = batch.batch["reward"] + self.rank + self.bonus
        return DataProto.from_dict({"score": scores, "rank": torch.full_like(scores, self.rank)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=None, help="ray (default), torchrun, inline, or $PODIUM_BACKEND")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    start = time.perf_counter()
    pool = ResourcePool([args.workers], use_gpu=False)
    with WorkerGroup(pool, ClassWithInitArgs(Scorer, bonus=0.0), backend=args.backend) as wg:
        started = time.perf_counter() - start
        batch = DataProto.from_dict({"reward": torch.zeros(8)})
        out = wg.score(batch)
        print(f"backend: {wg.backend}, {wg.world_size} workers started in {started:.1f} s")
        for i, (score, rank) in enumerate(zip(out.batch["score"].tolist(), out.batch["rank"].tolist())):
            print(f"  sample {i}: score {score:.1f} (from rank {int(rank)})")
        expected = [float(i // (8 // args.workers)) for i in range(8)]
        if out.batch["score"].tolist() != expected:
            raise SystemExit(f"unexpected scores: {out.batch['score'].tolist()} != {expected}")
        print("ok")


if __name__ == "__main__":
    main()
