"""YaRN RoPE scaling (DeepSeek-V3's ``rope_type: yarn``), as transformers computes it
(``_compute_yarn_parameters``): each frequency blended between the original one
(extrapolation, the fast-turning dimensions) and the one divided by ``factor``
(interpolation, the slow ones) over a linear ramp between the dimensions that turn
``beta_fast`` and ``beta_slow`` times in the original context; cos and sin scaled by the
attention factor (``mscale`` and ``mscale_all_dim`` where given)."""

from __future__ import annotations

import math

import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, s: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (``dim / 2``) and the attention factor for RoPE parameters ``s``."""
    original = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)
