"""Pure-torch references for the extra fused kernels (RMSNorm, SiLU-and-mul).

Numerics follow the Hugging Face Llama/Qwen modules exactly, so a model can switch between
the reference and the Triton kernel without changing its outputs beyond reduction order:
- RMSNorm: the residual add rounds to the input dtype first (``h = x + residual``); the
  statistics are computed in fp32; the normalised value is rounded to the input dtype and
  then multiplied by the weight (``weight * h_normed.to(dtype)``).
- SiLU-and-mul: ``silu(gate)`` is rounded to the input dtype, then multiplied by ``up``.
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
):
    """``x [..., hidden]`` -> ``out`` or, with ``residual``, ``(out, x + residual)``."""
    h = x if residual is None else (x + residual)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, h)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2 * d]`` (gate then up, as a fused gate_up projection) -> ``[..., d]``."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    act = torch.nn.functional.silu(gate.float()).to(x.dtype)
    return (act.float() * up.float()).to(x.dtype)
