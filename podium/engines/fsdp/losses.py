"""The token-level policy-gradient loss (GRPO / PPO style) with a k3 KL penalty.

Every function returns *sums* over the tokens it is given, never means: the engine
divides by the token count of the whole global batch, so the loss -- and hence the
gradient -- is the same however the batch is split over ranks and micro-batches.
"""

from __future__ import annotations

import torch

__all__ = ["kl_k3", "policy_loss_sums"]


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(r) - r - 1``, ``r = ref - logp``.

    Unbiased, always >= 0, and low-variance (Schulman, "Approximating KL divergence").
    """
    r = ref_log_probs - log_probs
    return torch.exp(r) - r - 1


def policy_loss_sums(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    clip_ratio: float = 0.2,
) -> dict[str, torch.Tensor]:
    """Sums over the masked tokens of: the loss, its policy-gradient part and the KL.

    ``advantages`` is per sequence ``[B]`` or per token ``[B, R]``. Without
    ``old_log_probs`` the update is on-policy: the ratio is ``exp(logp - logp.detach())``
    (value 1, gradient of ``logp``); with them, the PPO clipped ratio.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    ratio = torch.exp(log_probs - old)
    pg = -torch.minimum(
        ratio * advantages, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * advantages
    )
    mask = mask.to(log_probs.dtype)
    if ref_log_probs is not None:
        kl = kl_k3(log_probs, ref_log_probs)
    else:
        kl = torch.zeros_like(log_probs)
    loss = pg + kl_coef * kl
    return {
        "loss": (loss * mask).sum(),
        "pg_loss": (pg * mask).sum().detach(),
        "kl": (kl * mask).sum().detach(),
    }
