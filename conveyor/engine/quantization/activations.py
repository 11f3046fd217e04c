"""Activations quantized to e4m3 before a W8A8 layer's matmul, as the checkpoint's format says:
by the checkpoint's static ``input_scale``, or by a scale computed from the input itself (one
for the whole tensor, one per token, one per group of ``group_size`` inputs of a token).

The arithmetic is compressed-tensors' (and vLLM's): ``scale = absmax / 448`` (a zero scale
replaced by float32's eps), ``q = e4m3(clamp(x / scale, -448, 448))``, ``x ~ q * scale``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
# What compressed-tensors puts in place of a zero scale (an all-zero token).
_ZERO_SCALE = float(torch.finfo(torch.float32).eps)
STRATEGIES = ("static", "tensor", "token", "group")


@dataclass(frozen=True)
class ActivationQuant:
    # "static" (the checkpoint's per-tensor input_scale) or, computed from each input:
    # "tensor" (one scale), "token" (one a row), "group" (one per ``group_size`` inputs of a row).
    strategy: str
    group_size: int = 0

    def __post_init__(self) -> None:
        assert self.strategy in STRATEGIES, self.strategy
        assert (self.strategy == "group") == (self.group_size > 0), self

    def scale(self, x: torch.Tensor, static_scale: float | None) -> torch.Tensor:
        """The float32 scale of ``x [M, K]``: ``[]``, ``[M, 1]`` or ``[M, K / group_size]``."""
        if self.strategy == "static":
            assert static_scale is not None, "a static activation scale is read from the checkpoint"
            # (a fill, not a copy from the host: allowed while a CUDA graph is captured)
            return torch.full((), static_scale, dtype=torch.float32, device=x.device)
        magnitude = x.float().abs()
        if self.strategy == "tensor":
            absmax = magnitude.amax()
        elif self.strategy == "token":
            absmax = magnitude.amax(dim=-1, keepdim=True)
        else:
            absmax = magnitude.reshape(x.shape[0], -1, self.group_size).amax(dim=-1)
        scale = absmax / E4M3_MAX
        return torch.where(scale == 0, torch.full_like(scale, _ZERO_SCALE), scale)

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` in e4m3 at ``scale`` (from ``scale()``)."""
        return (x.float() / self._per_input(scale, x.shape[-1])).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The float32 values ``q`` stands for."""
        return q.float() * self._per_input(scale, q.shape[-1])

    def _per_input(self, scale: torch.Tensor, cols: int) -> torch.Tensor:
        return scale.repeat_interleave(self.group_size, dim=-1)[:, :cols] if self.strategy == "group" else scale
