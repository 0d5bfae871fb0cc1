"""Closing the engines of a process frees its process group while Python still runs.

FSDP2 leaves device meshes in DTensor's sharding caches, and a mesh keeps its process
groups alive: before ``close()`` cleared them, gloo's threads outlived
``destroy_process_group()`` and were torn down with the interpreter, where one that
touched a tensor aborted the rank ("terminate called without an active exception",
SIGABRT after the last step of a run). So after the last engine of a process closes, no
gloo thread may be left, whichever engine (the one that created the group or not) closes
first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import torch
from podium.engines.fsdp import EngineConfig, LMConfig, TrainingWorker
from podium.testing.conformance.workers import gloo_threads

cfg = LMConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
actor = TrainingWorker(EngineConfig(model=cfg, kl_coef=0.1))
actor.init_model()  # creates the process group
ref = TrainingWorker(EngineConfig(model=cfg, trainable=False))
ref.init_model()
ids = torch.randint(0, 16, (4, 10))
resp = ids[:, -4:]
logp = ref.engine.compute_log_prob(ids, 4)
actor.engine.train_step({"input_ids": ids, "responses": resp, "advantages": torch.ones(4),
                         "ref_log_probs": logp})
assert gloo_threads(), "the engine's process group runs no gloo thread: nothing to check"
first, second = (actor, ref) if sys.argv[1] == "owner-first" else (ref, actor)
first.shutdown()
open_after_first = torch.distributed.is_initialized()
second.shutdown()
print("open after first close:", open_after_first)
print("gloo threads after close:", gloo_threads())
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("order", ["owner-first", "owner-last"])
def test_no_gloo_thread_outlives_the_last_engine(order: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, order],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The group stays while another engine of the process still uses it.
    assert "open after first close: True" in proc.stdout, proc.stdout
    assert "gloo threads after close: []" in proc.stdout, proc.stdout
