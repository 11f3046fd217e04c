"""Triton kernels for the small memory-bound ops around attention: RMSNorm (optionally
fused with the residual add) and SiLU-and-mul. Same signatures and numerics as their
references in ``conveyor.kernels.reference``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import cdiv, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / hidden
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``x [..., hidden]`` -> ``out`` or, with ``residual``, ``(out, x + residual)``."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,)
    x2 = _rows(x, hidden)
    rows = x2.shape[0]
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = _rows(residual, hidden)
        res_out = torch.empty_like(out)
    else:
        r2 = res_out = out  # unused
    if rows:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight.contiguous(),
            out,
            res_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2 * d]`` (gate then up) -> ``silu(gate) * up``, ``[..., d]``."""
    d = x.shape[-1] // 2
    assert x.shape[-1] == 2 * d
    x2 = _rows(x, 2 * d)
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, next_pow2(d))
        _silu_and_mul_kernel[(rows, cdiv(d, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            d,
            BLOCK=block,
            num_warps=4 if block >= 512 else 2,
        )
    return out.view(*x.shape[:-1], d)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with a contiguous last dimension, as the kernels index it."""
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()
