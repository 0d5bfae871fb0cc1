"""Sampling whose randomness belongs to each sample, not to a rank or a process.

A sample's random numbers come from a generator seeded by ``(seed, step, global
sample index)``, drawn up front, and turned into tokens by inverse-CDF sampling. The
completions therefore do not depend on which rank a sample lands on, on the world
size or mesh shape, or on the launcher, and the global RNG is never touched (a resumed
run needs no RNG state).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["per_sample_uniforms", "sample_tokens"]


def per_sample_uniforms(
    seed: int, step: int, sample_index: torch.Tensor, count: int
) -> torch.Tensor:
    """``[B, count]`` float64 uniforms in [0, 1); row ``i`` depends only on ``(seed, step, sample_index[i])``."""
    rows = [
        np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, int(i)]))).random(
            count
        )
        for i in sample_index.tolist()
    ]
    if not rows:
        return torch.empty(0, count, dtype=torch.float64)
    return torch.from_numpy(np.stack(rows))


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float) -> torch.Tensor:
    """One token per row from ``logits [B, V]``: inverse CDF at ``uniforms [B]``; greedy at temperature 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    u = uniforms.to(cdf.device, torch.float64).reshape(-1, 1).contiguous()
    picked = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return picked.clamp_(max=logits.shape[-1] - 1)
