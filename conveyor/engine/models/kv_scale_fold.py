"""A checkpoint's FP8 KV cache scales applied by folding them into attention's inputs and
output, so the backends and kernels keep storing e4m3 with a scale of 1. With ``K8 =
e4m3(k / k_scale)`` in the cache, ``q . k = (q * k_scale) . (k / k_scale)``, and with ``V8 =
e4m3(v / v_scale)``, ``probs @ v = (probs @ (v / v_scale)) * v_scale``: the scores, so soft
caps and sinks, are unchanged. Scales are per tensor or per KV head; a query head takes its KV
head's."""

from __future__ import annotations

import torch
from torch import nn


class KVScaleFold(nn.Module):
    """Identity until ``set`` gives it this layer's scales (this rank's KV heads')."""

    # [heads, 1] buffers in the model's dtype, broadcast over [tokens, heads, head_dim].
    q_factor: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    out_factor: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def set(self, k_scale: torch.Tensor, v_scale: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """``k_scale``/``v_scale``: one per KV head of this layer (``[num_kv_heads]``)."""
        group = num_heads // k_scale.numel()
        for name, scale in (
            ("k_scale", k_scale),
            ("v_scale", v_scale),
            ("q_factor", k_scale.repeat_interleave(group)),
            ("out_factor", v_scale.repeat_interleave(group)),
        ):
            self.register_buffer(name, scale.to(dtype).reshape(-1, 1), persistent=False)
        self.active = True

    def fold_in(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries, keys and values the backend gets (``[tokens, heads, head_dim]``)."""
        if not self.active:
            return q, k, v
        return q * self.q_factor, k / self.k_scale, v / self.v_scale

    def fold_out(self, out: torch.Tensor) -> torch.Tensor:
        """The backend's output (``[tokens, heads, head_dim]``) back at the values' scale."""
        return out * self.out_factor if self.active else out
