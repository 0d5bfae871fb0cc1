"""``EngineConfig``: everything that decides an engine's numbers, in one validated record.

Results are launcher-independent only if nothing is inherited from the launcher: the
intra-op thread count (torchrun sets ``OMP_NUM_THREADS=1``, Ray does not, and it changes
float results on CPU), the seed the model is built from, and how the batch is split
(``micro_batch_size``) are all fields here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from podium.engines.fsdp.model import LMConfig

__all__ = ["EngineConfig"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an :class:`~podium.engines.fsdp.FSDPEngine` builds, shards and trains its model.

    ``model_factory`` builds the model (any ``nn.Module`` mapping ``input_ids [B, T]``
    to logits ``[B, T, V]``, or an object with ``.logits`` such as a Hugging Face
    output); when ``None`` the engine builds :class:`~podium.engines.fsdp.TinyLM`
    from ``model``. It runs after ``torch.manual_seed(seed)`` on every rank, so every
    rank starts from the same weights. ``trainable=False`` builds no optimizer (a
    frozen reference model).
    """

    model: LMConfig = field(default_factory=LMConfig)
    model_factory: Callable[[], nn.Module] | None = None
    seed: int = 0
    tp: int = 1
    trainable: bool = True
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    micro_batch_size: int | None = None
    kl_coef: float = 0.0
    clip_ratio: float = 0.2
    threads: int | None = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    mixed_precision: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, LMConfig):
            raise TypeError(
                f"EngineConfig.model must be an LMConfig, got {type(self.model).__name__}"
            )
        if self.model_factory is not None and not callable(self.model_factory):
            raise TypeError(
                f"EngineConfig.model_factory must be callable, got {self.model_factory!r}"
            )
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"EngineConfig.tp must be an int >= 1, got {self.tp!r}")
        if self.tp > 1 and self.model_factory is None and self.model.n_heads % self.tp:
            raise ValueError(
                f"EngineConfig: tp={self.tp} must divide the model's n_heads={self.model.n_heads} "
                "(each TP rank holds whole attention heads)"
            )
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0):
            raise ValueError(f"EngineConfig.lr must be a number >= 0, got {self.lr!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"EngineConfig.max_grad_norm must be > 0 or None (no clipping), got {self.max_grad_norm!r}"
            )
        if self.micro_batch_size is not None and (
            not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1
        ):
            raise ValueError(
                f"EngineConfig.micro_batch_size must be an int >= 1 or None (the whole shard), "
                f"got {self.micro_batch_size!r}"
            )
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(
                f"EngineConfig.threads must be an int >= 1 or None (leave torch's setting), got {self.threads!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(
                f"EngineConfig.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}"
            )
        if self.kl_coef < 0 or self.clip_ratio <= 0:
            raise ValueError(
                f"EngineConfig: kl_coef must be >= 0 and clip_ratio > 0, got {self.kl_coef!r}, {self.clip_ratio!r}"
            )
