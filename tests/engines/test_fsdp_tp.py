"""dp x tp on CPU/gloo: a 2 x 2 mesh on 4 ranks against pure FSDP on 4 ranks.

The nd-mesh dispatch sends one shard per DP replica -- the same object to both TP ranks,
so backends serialize it once -- and collects one output per replica; the trainer's
per-step losses match dp=4 to 1e-4 relative and its sampled completions are identical.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _runs import run_grpo

from podium import ClassWithInitArgs, DataProto, ResourcePool, WorkerGroup
from podium.core.decorator import get_method_spec, resolve_dispatch_mode
from podium.engines.fsdp import EngineConfig, LMConfig, TinyLM, TrainingWorker

pytestmark = pytest.mark.slow

CFG = LMConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


@pytest.mark.timeout(300)
def test_nd_mesh_sends_one_shard_per_replica_and_collects_one_output_per_replica() -> None:
    config = EngineConfig(model=CFG, seed=5, tp=2, trainable=False)
    with WorkerGroup(
        ResourcePool([4], use_gpu=False),
        ClassWithInitArgs(TrainingWorker, config),
        backend="torchrun",
    ) as wg:
        places = wg.init_model()
        assert [(p["dp_rank"], p["tp_rank"]) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1)]

        torch.manual_seed(0)
        input_ids = torch.randint(0, 16, (6, 10))
        data = DataProto.from_dict({"input_ids": input_ids, "responses": input_ids[:, -4:]})

        mode = resolve_dispatch_mode(get_method_spec(TrainingWorker.compute_log_prob).dispatch_mode)
        (per_rank,), _ = mode.dispatch_fn(wg, data)
        assert per_rank[0] is per_rank[1] and per_rank[2] is per_rank[3]  # one object per replica
        assert torch.equal(per_rank[0].batch["input_ids"], input_ids[:3])
        assert torch.equal(per_rank[2].batch["input_ids"], input_ids[3:])

        out = wg.compute_log_prob(data)
        # 2 replicas x 3 rows: the TP-rank-1 outputs are not collected.
        assert out.batch["log_probs"].shape == (6, 4)

    torch.manual_seed(5)  # the engine builds its model right after manual_seed(seed)
    model = TinyLM(CFG)
    with torch.no_grad():
        logits = model(input_ids[:, :-1])[:, -4:]
        expected = torch.log_softmax(logits, -1).gather(-1, input_ids[:, -4:, None]).squeeze(-1)
    torch.testing.assert_close(out.batch["log_probs"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
def test_trainer_dp2_tp2_matches_dp4(tmp_path: Path) -> None:
    flags = ("--world-size", "4", "--steps", "3", "--seed", "1")
    dp4 = run_grpo(tmp_path / "dp4", *flags, backend="torchrun")
    tp2 = run_grpo(tmp_path / "tp2", *flags, "--tp", "2", backend="torchrun")
    assert [r["step"] for r in tp2] == [1, 2, 3]
    for a, b in zip(dp4, tp2):
        assert a["completions_sha256"] == b["completions_sha256"]
        assert _close(a["loss"], b["loss"]), (a["loss"], b["loss"])
        assert _close(a["kl"], b["kl"]), (a["kl"], b["kl"])


def _close(a: Any, b: Any) -> bool:
    # 1e-4 relative. At step 1 the loss is the mean of group-normalized advantages:
    # zero up to float32 rounding (~1e-8), where a relative bound means nothing.
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-7)
