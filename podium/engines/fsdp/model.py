"""A small decoder-only transformer that ships with the engine for tests and examples.

Pre-norm GPT blocks (causal self-attention + GELU MLP), learned positions, an untied
output head. Two hooks make it shard-friendly:

- :func:`blocks` lists the modules FSDP2 wraps one by one (each transformer block);
- :func:`tensor_parallel_plan` gives the colwise/rowwise plan of each block for
  ``parallelize_module``. Under tensor parallelism the q/k/v projections return local
  tensors of width ``d_model / tp``, so attention derives its head count from the tensor,
  never from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["LMConfig", "TinyLM", "blocks", "tensor_parallel_plan"]


@dataclass(frozen=True, kw_only=True)
class LMConfig:
    """Shape of :class:`TinyLM`; checked when built."""

    vocab_size: int = 16
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LMConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"LMConfig: d_model {self.d_model} must be a multiple of n_heads {self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Attention(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.o = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_dim  # local heads: all of them, or n_heads / tp
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """``forward(input_ids [B, T]) -> logits [B, T, vocab]`` (float32 logits)."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.tok(input_ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        # A fresh tensor, not a view: FSDP2's root hooks warn on (and in-place ops break) views.
        return logits.float() if logits.dtype != torch.float32 else logits.clone()


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one before the root (transformer blocks)."""
    found = getattr(model, "blocks", None)
    if isinstance(found, nn.ModuleList):
        return list(found)
    # Hugging Face causal LMs keep their decoder layers under model.layers (Llama, Qwen, ...).
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    return []


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of one :class:`Block`: colwise in, rowwise out."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(),
    }
