"""``FSDPEngine``: one rank's share of a model sharded with FSDP2 over a ``DeviceMesh``.

Pure FSDP (a 1-D ``("dp",)`` mesh) or ``dp x tp`` (a 2-D ``("dp", "tp")`` mesh: torch's
tensor parallel inside each block, then ``fully_shard`` over ``dp``). gloo on CPU, NCCL on
GPU with the device ``LOCAL_RANK`` modulo the visible devices, bf16 compute on GPU.

Every method is collective: all ranks of the mesh call it in the same order with their
shard of the data (ranks of one TP group with the *same* shard). Losses are normalized
by the token count of the global batch, so the gradient does not depend on how the batch
is split over ranks and micro-batches.
"""

from __future__ import annotations

import gc
import json
import math
import os
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from podium.core.host import clear_dtensor_caches
from podium.engines.fsdp.config import EngineConfig
from podium.engines.fsdp.losses import policy_loss_sums
from podium.engines.fsdp.model import TinyLM, blocks, tensor_parallel_plan
from podium.engines.fsdp.sampling import per_sample_uniforms, sample_tokens

__all__ = ["FSDPEngine", "init_distributed"]

_META_FILE = "podium_engine.json"

# The engines of this process that are open (one dropped unclosed no longer counts),
# and whether the process group one of them created waits for the last of them to
# close before it is destroyed.
_open_engines: weakref.WeakSet[FSDPEngine] = weakref.WeakSet()
_group_to_destroy = False
# What close() frees: the model and everything that holds its device mesh.
_CLOSED_ATTRS = frozenset({"model", "optimizer", "mesh", "dp_mesh", "dp_group"})


def init_distributed(device: str = "auto") -> tuple[str, bool]:
    """Join (or reuse) the default process group; return its device type and whether this call created it.

    Reads the env:// variables every podium backend with processes sets. A
    single rank without ``MASTER_ADDR`` (the inline backend, a notebook) gets a
    private in-memory store instead.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("EngineConfig.device='cuda' but torch sees no CUDA device on this rank")
    device_type = "cuda" if use_cuda else "cpu"
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if dist.is_initialized():
        return device_type, False
    backend = "nccl" if use_cuda else "gloo"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" not in os.environ:
        if world != 1:
            raise RuntimeError(
                f"WORLD_SIZE={world} but MASTER_ADDR is not set: start the ranks with a podium backend "
                "that has a process group (ray, torchrun) or with torchrun"
            )
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    return device_type, True


class FSDPEngine:
    """Builds, shards and trains one model; see the module docstring for the collective contract."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.device_type, self.owns_process_group = init_distributed(config.device)
        self.device = (
            torch.device(self.device_type, torch.cuda.current_device())
            if self.device_type == "cuda"
            else torch.device("cpu")
        )
        world = dist.get_world_size()
        if world % config.tp:
            raise ValueError(
                f"tensor-parallel size {config.tp} does not divide the world size {world}; "
                f"use a tp that divides {world}"
            )
        self.tp_size = config.tp
        self.dp_size = world // config.tp
        if config.tp > 1:
            self.mesh: DeviceMesh = init_device_mesh(
                self.device_type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp")
            )
            self.dp_mesh = self.mesh["dp"]
            self.tp_rank = self.mesh["tp"].get_local_rank()
        else:
            self.mesh = init_device_mesh(self.device_type, (self.dp_size,), mesh_dim_names=("dp",))
            self.dp_mesh = self.mesh
            self.tp_rank = 0
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.dp_group = self.dp_mesh.get_group()
        self.mixed_precision = (
            self.device_type == "cuda" if config.mixed_precision is None else config.mixed_precision
        )
        self.model = self._build_model()
        self.optimizer: torch.optim.Optimizer | None = None
        if config.trainable:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=config.lr,
                betas=config.betas,
                weight_decay=config.weight_decay,
            )
        else:
            self.model.requires_grad_(False)
        self.step = 0
        _open_engines.add(self)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes that are not set: the ones close() freed.
        if name in _CLOSED_ATTRS:
            raise RuntimeError(f"this engine was closed: it has no {name} any more")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- building --------------------------------------------------------------

    def _build_model(self) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        cfg = self.config
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = cfg.model_factory() if cfg.model_factory is not None else TinyLM(cfg.model)
        model.to(self.device)
        if self.tp_size > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            layers = blocks(model)
            if not layers or not isinstance(model, TinyLM):
                raise ValueError(
                    "tensor parallelism (tp > 1) needs the plan of the model's blocks; it is known "
                    "for podium's TinyLM only -- use tp=1 (pure FSDP) for other models"
                )
            for block in layers:
                parallelize_module(block, self.mesh["tp"], tensor_parallel_plan())
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.mixed_precision
            else MixedPrecisionPolicy()
        )
        for block in blocks(model):
            fully_shard(block, mesh=self.dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=self.dp_mesh, mp_policy=mp)
        return model

    # -- forward ---------------------------------------------------------------

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids.to(self.device))
        logits = out.logits if hasattr(out, "logits") else out
        return logits.float()

    def _micro_batches(self, n: int) -> list[slice]:
        size = self.config.micro_batch_size or max(n, 1)
        return [slice(i, min(i + size, n)) for i in range(0, n, size)] or [slice(0, 0)]

    def _response_log_probs(
        self, input_ids: torch.Tensor, response_length: int, temperature: float
    ) -> torch.Tensor:
        """Log-probabilities ``[B, R]`` of the last ``R`` tokens of ``input_ids``."""
        logits = self._logits(input_ids[:, :-1])[:, -response_length:]
        if temperature not in (0, 1):
            logits = logits / temperature
        targets = input_ids[:, -response_length:].to(logits.device)
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)

    @torch.no_grad()
    def compute_log_prob(
        self, input_ids: torch.Tensor, response_length: int, temperature: float = 1.0
    ) -> torch.Tensor:
        """Log-probabilities of the responses (the last ``response_length`` tokens), on CPU."""
        self.model.eval()
        parts = [
            self._response_log_probs(input_ids[mb], response_length, temperature).cpu()
            for mb in self._micro_batches(input_ids.shape[0])
        ]
        return torch.cat(parts)

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        sample_index: torch.Tensor,
        *,
        max_new_tokens: int,
        step: int,
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to each prompt; return the responses ``[B, R]``.

        Sample ``i``'s randomness is seeded by ``(seed, step, sample_index[i])``
        (see :mod:`podium.engines.fsdp.sampling`); ``seed`` defaults to the config's.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.model.eval()
        seed = self.config.seed if seed is None else seed
        uniforms = per_sample_uniforms(seed, step, sample_index, max_new_tokens)
        out = []
        for mb in self._micro_batches(prompts.shape[0]):
            seq = prompts[mb].to(self.device)
            for t in range(max_new_tokens):
                logits = self._logits(seq)[:, -1]
                token = sample_tokens(logits, uniforms[mb, t], temperature)
                seq = torch.cat([seq, token[:, None].to(seq.dtype)], dim=1)
            out.append(seq[:, prompts.shape[1] :].cpu())
        return torch.cat(out)

    # -- training --------------------------------------------------------------

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    def train_step(
        self, batch: Mapping[str, torch.Tensor], temperature: float = 1.0
    ) -> dict[str, float]:
        """One optimizer step on this rank's shard of a policy-gradient batch; metrics of the global batch.

        ``batch`` holds ``input_ids [B, T]``, ``responses [B, R]`` (the last ``R`` tokens
        of ``input_ids``), ``advantages [B]`` or ``[B, R]``, and optionally
        ``response_mask [B, R]``, ``old_log_probs [B, R]`` (PPO ratio; on-policy without)
        and ``ref_log_probs [B, R]`` (KL penalty with ``kl_coef``). The returned loss, KL
        and grad norm are the same on every rank.
        """
        if self.optimizer is None:
            raise RuntimeError(
                "this engine was built with trainable=False (a frozen model); it cannot train"
            )
        for key in ("input_ids", "responses", "advantages"):
            if key not in batch:
                raise KeyError(f"train_step needs {key!r} in the batch; got {sorted(batch.keys())}")
        if self.config.kl_coef > 0 and "ref_log_probs" not in batch:
            raise KeyError(
                "kl_coef > 0 needs 'ref_log_probs' in the batch (compute them with the reference model)"
            )
        input_ids = batch["input_ids"]
        r = batch["responses"].shape[1]
        mask = (
            batch["response_mask"]
            if "response_mask" in batch
            else torch.ones(input_ids.shape[0], r)
        )
        total_tokens = self._all_reduce_sum([float(mask.sum())])[0]
        if total_tokens <= 0:
            raise ValueError("the global batch has no response tokens to train on")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0}
        for mb in self._micro_batches(input_ids.shape[0]):
            logp = self._response_log_probs(input_ids[mb], r, temperature)
            dev = logp.device
            parts = policy_loss_sums(
                logp,
                batch["advantages"][mb].to(dev, torch.float32),
                mask[mb].to(dev),
                old_log_probs=batch["old_log_probs"][mb].to(dev)
                if "old_log_probs" in batch
                else None,
                ref_log_probs=batch["ref_log_probs"][mb].to(dev)
                if "ref_log_probs" in batch
                else None,
                kl_coef=self.config.kl_coef,
                clip_ratio=self.config.clip_ratio,
            )
            # FSDP averages gradients over dp; scaling by dp / tokens makes the result
            # the gradient of the global per-token mean.
            (parts["loss"] * (self.dp_size / total_tokens)).backward()
            for k in sums:
                sums[k] += float(parts[k].detach())
        grad_norm = self._clip_grad_norm()
        self.optimizer.step()
        self.step += 1
        loss, pg, kl = self._all_reduce_sum([sums["loss"], sums["pg_loss"], sums["kl"]])
        return {
            "loss": loss / total_tokens,
            "pg_loss": pg / total_tokens,
            "kl": kl / total_tokens,
            "grad_norm": grad_norm,
            "tokens": total_tokens,
            "step": float(self.step),
        }

    def _clip_grad_norm(self) -> float:
        """Total gradient norm (the same float on every rank); clip to ``max_grad_norm``.

        Each rank sums the squares of its local gradient pieces, divided by how many
        ranks hold a copy of that piece (the mesh dimensions it is replicated over), and
        one float64 all-reduce over the world adds them up. torch's ``clip_grad_norm_``
        cannot combine the 2-D (dp x tp) and 1-D (dp) meshes of a tensor-parallel model,
        and reducing over each mesh dimension in turn may round differently per rank.
        """
        from torch.distributed.tensor import DTensor, Replicate

        world = dist.get_world_size()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            if isinstance(g, DTensor):
                copies = math.prod(
                    g.device_mesh.size(i)
                    for i, pl in enumerate(g.placements)
                    if isinstance(pl, Replicate)
                )
                copies *= world // g.device_mesh.size()  # ranks outside the grad's mesh
                piece = g.to_local()
            else:
                copies, piece = world, g
            local += piece.double().pow(2).sum() / copies
        dist.all_reduce(local)
        total = math.sqrt(float(local))
        max_norm = self.config.max_grad_norm
        if max_norm is not None and total > max_norm:
            coef = max_norm / (total + 1e-6)
            for g in grads:
                g.mul_(coef)
        return total

    # -- checkpoints -----------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save model, optimizer and step to the directory ``path`` (sharded, every rank writes its part)."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        dcp.save(self._state(), checkpoint_id=str(path))
        if dist.get_rank() == 0:
            meta = {"step": self.step, "world_size": dist.get_world_size(), "tp": self.tp_size}
            (path / _META_FILE).write_text(json.dumps(meta))
        dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Load a checkpoint written by :meth:`save_checkpoint`; return its step.

        Call it before any backward pass: torch initializes the optimizer's state
        for loading only while no parameter has a gradient.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        path = Path(path)
        meta_file = path / _META_FILE
        if not meta_file.is_file():
            raise FileNotFoundError(
                f"{path} is not an engine checkpoint (no {_META_FILE}); pass a directory written by save_checkpoint"
            )
        state = self._state()
        dcp.load(state, checkpoint_id=str(path))
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        self.step = int(json.loads(meta_file.read_text())["step"])
        return self.step

    def close(self) -> None:
        """Free the model; the last engine of the process to close destroys the process group
        one of them created.

        The group must really go while Python still runs: gloo's threads are joined when
        the last reference to the group goes, and a group that lives on to interpreter
        exit can abort the process there ("terminate called without an active
        exception"). FSDP's device meshes hold the groups, and DTensor's sharding caches
        hold the meshes, so those caches are emptied too (they refill on the next use).
        """
        global _group_to_destroy
        if self not in _open_engines:
            return
        _open_engines.discard(self)
        for name in _CLOSED_ATTRS:
            self.__dict__.pop(name, None)
        _group_to_destroy = _group_to_destroy or self.owns_process_group
        self.owns_process_group = False
        clear_dtensor_caches()
        gc.collect()
        if _group_to_destroy and not _open_engines:
            _group_to_destroy = False
            if dist.is_initialized():
                dist.destroy_process_group()
