"""Triton GEMM over int4 weights, dequantized in the K loop (W4A16): ``x @ W.T`` with ``W``
never materialised. One packed layout for AWQ, GPTQ and compressed-tensors int4 (each
repacks to it): ``qweight`` [N, K/8] int32, eight consecutive inputs a word, lowest bits
first, unsigned 0..15; ``scales`` [N, K/group] and ``zeros`` [N, K/group] (unsigned, 8 for a
symmetric checkpoint); ``W[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group]``.
Same arithmetic as ``kernels.reference.w4a16_gemm``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import cdiv


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # A tile's words [BLOCK_N, BLOCK_K / 8], each split into its eight nibbles (the launcher
    # keeps BLOCK_K within one group, a multiple of 8).
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        ws = k0 // 8 + offs_w
        words = tl.load(
            qweight_ptr + offs_n[:, None] * stride_qn + ws[None, :],
            mask=mask_n[:, None] & (ws < K // 8)[None, :],
            other=0,
        )
        q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + offs_n * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + offs_n * stride_zn + group, mask=mask_n, other=0).to(tl.float32)
        w = ((q.to(tl.float32) - zero[:, None]) * scale[:, None]).to(x.dtype)
        if IEEE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])


def choose_tiles(m: int, group_size: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)``: small M tiles for decode batches, a K tile
    inside one group."""
    block_k = min(64, group_size)
    if m <= 16:
        return 16, 64, block_k, 4
    return 64, 64, block_k, 8


def w4a16_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x [M, K]`` times the int4 weight ``[N, K]`` transposed -> ``[M, N]`` in ``x``'s dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.dtype == torch.int32 and qweight.shape[1] * 8 == k
    assert k % group_size == 0 and group_size % 16 == 0, "groups of a multiple of 16 inputs tiling K"
    assert scales.shape == zeros.shape == (n, k // group_size)
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps = choose_tiles(m, group_size)
    grid = (cdiv(m, bm), cdiv(n, bn))
    _w4a16_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE_DOT=x.dtype == torch.float32,
        num_warps=warps,
    )
    return out
