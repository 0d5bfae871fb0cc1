"""Real work through Slurm: a 2-rank gloo all-reduce and one FSDP training step, in one job.

The same job shows that the group's CURVE secrets stay out of everything Slurm
keeps or shows (the batch script, ``scontrol show job``, files others can
read), and that ``shutdown()`` ends the job.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from podium import ClassWithInitArgs, DataProto, Dispatch, ResourcePool, WorkerGroup, register
from podium.engines.fsdp import EngineConfig, LMConfig, TrainingWorker

pytestmark = pytest.mark.timeout(240)

SLURM = {"scheduler": "slurm", "scheduler_cfg": {"partition": "debug"}}
CFG = LMConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)


class Trainer(TrainingWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> tuple[str, float]:
        import torch.distributed as dist

        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t)
        return dist.get_backend(), float(t.item())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)


@pytest.fixture(scope="module")
def trainer(slurm: Any) -> Iterator[WorkerGroup]:
    config = EngineConfig(model=CFG, seed=2, lr=1e-2, micro_batch_size=2)
    group = WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(Trainer, config),
        backend="torchrun",
        backend_options=SLURM,
        name_prefix="slurm-fsdp",
    )
    yield group
    group.shutdown()


def _job(wg: WorkerGroup) -> str:
    handle = wg._group.app_handle  # type: ignore[attr-defined]
    return str(handle).rsplit("/", 1)[-1]


def test_gloo_all_reduce_over_two_ranks(trainer: WorkerGroup) -> None:
    trainer.init_model()
    assert trainer.all_reduce(1.5) == [("gloo", 4.5), ("gloo", 4.5)]


def test_one_fsdp_training_step(trainer: WorkerGroup) -> None:
    prompts = torch.stack([torch.arange(4) + i % 5 for i in range(4)])
    gen = trainer.generate(
        DataProto.from_dict(
            {"prompts": prompts, "sample_index": torch.arange(4)},
            meta_info={"step": 1, "max_new_tokens": 4},
        )
    )
    ids, resp = gen.batch["input_ids"], gen.batch["responses"]
    adv = (resp < 8).float().mean(1)
    batch = DataProto.from_dict(
        {"input_ids": ids, "responses": resp, "advantages": adv - adv.mean()}
    )
    metrics: list[dict[str, Any]] = trainer.train_batch(batch)
    assert metrics and all(math.isfinite(m["loss"]) for m in metrics)
    assert metrics[0]["grad_norm"] > 0 and metrics[0]["tokens"] == 4 * 4


def _world_readable_files(*roots: Path) -> Iterator[Path]:
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in files:
                path = Path(dirpath, name)
                try:
                    mode = path.lstat().st_mode
                except OSError:
                    continue
                if stat.S_ISREG(mode) and mode & stat.S_IROTH:
                    yield path


def test_curve_secrets_stay_out_of_what_slurm_keeps_and_shows(
    trainer: WorkerGroup, slurm: Any, job_dir: Path
) -> None:
    group: Any = trainer._group  # type: ignore[attr-defined]
    keys = group.channel.keys
    secrets = [keys.server_secret, *(secret for _, secret in keys.clients)]
    job = _job(trainer)
    shown = slurm.run("scontrol", "show", "job", "-d", job)
    script = slurm.run("scontrol", "write", "batch_script", job, "-")
    assert "srun" in script and "PODIUM_TR_ADDR" in script  # the real script, with its env list
    for secret in secrets:
        assert secret.decode() not in shown and secret.decode() not in script
    # The ranks' key files were read and deleted by their supervisors.
    key_dir = Path(group.worker_env()["PODIUM_TR_KEYS"])
    assert key_dir.parent == job_dir
    assert not key_dir.exists() or list(key_dir.iterdir()) == []
    slurm_dir = Path(os.environ["SLURM_CONF"]).parent.parent
    for path in _world_readable_files(job_dir, slurm_dir):
        data = path.read_bytes()
        assert not any(secret in data for secret in secrets), path


def test_the_controller_address_reaches_the_ranks_through_the_job_environment(
    trainer: WorkerGroup,
) -> None:
    from podium.backends.torchrun.schedulers import reachable_host

    group: Any = trainer._group  # type: ignore[attr-defined]
    addr = group.channel.address
    # This host's address as other hosts see it (loopback only on a host with no other).
    assert addr.startswith(f"tcp://{reachable_host()}:")
    assert trainer.getenv("PODIUM_TR_ADDR") == [addr, addr]


def test_shutdown_ends_the_job(trainer: WorkerGroup, slurm: Any) -> None:
    job = _job(trainer)
    assert job in slurm.queue()
    trainer.shutdown()
    assert slurm.wait_gone(job, timeout=20)
    assert slurm.state(job) in ("COMPLETED", "CANCELLED")


def test_podium_backends_reports_slurm_as_usable(slurm: Any) -> None:
    # What `podium backends` prints under torchrun (its output is tested in tests/core).
    from podium.backends.torchrun.schedulers import scheduler_report

    rows = {name: (usable, why) for name, usable, why in scheduler_report()}
    usable, why = rows["slurm"]
    assert usable and "debug" in why and "queued" in why, why
