"""Triton GEMMs over quantized weights, dequantized tile by tile in the K loop: ``x @ W.T``
with ``W`` never materialised. Same arithmetic as their references in ``conveyor.kernels.reference``.

- ``w4a16_gemm``: one packed int4 layout for AWQ, GPTQ and compressed-tensors (each repacks to
  it): ``qweight`` [N, K/8] int32, eight consecutive inputs a word, lowest bits first, unsigned
  0..15; ``scales`` and ``zeros`` [N, K/group] (zeros unsigned, 8 for a symmetric checkpoint);
  ``W[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group]``.
- ``fp8_block_gemm``: e4m3 ``weight`` [N, K] times one float32 scale per ``block`` (128x128 in
  Qwen's and DeepSeek's releases; the edge blocks short), or one scale for the tensor.
  Activations stay in their dtype (W8A16).
- ``q8_0_gemm``: GGUF's Q8_0 kept quantized: per row, blocks of 32 int8 values and their fp16
  scale (``gguf_blocks.split_q8_0`` takes llama.cpp's 34-byte blocks apart, the same bytes in two tensors);
  ``W[n, k] = qs[n, k] * d[n, k // 32]``.
- ``q4_k_gemm``: GGUF's Q4_K kept quantized: per row, super-blocks of 256 inputs in eight
  sub-blocks of 32, each with a 6-bit scale and a 6-bit min packed in 12 bytes, times the
  super-block's fp16 ``d`` and ``dmin`` (``gguf_blocks.split_q4_k`` takes llama.cpp's 144-byte blocks
  apart); ``W = d * sc * q - dmin * m`` with ``q`` the unsigned nibble.

Every GEMM launches the same way (``_launch``): one program per ``BLOCK_M x BLOCK_N`` output
tile, the kernel's arguments ``x, *weights, out, M, N, K``, then the row strides of each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from .e4m3 import e4m3_in_arithmetic, e4m3_to_float
from .gguf_blocks import Q4_K_BLOCK, Q4_K_SCALE_BYTES, Q8_0_BLOCK
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


def choose_tiles(m: int, block_k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` for every quantized GEMM: small M tiles for
    decode batches, a K tile of at most 64 inside one scale block of ``block_k`` inputs."""
    bk = min(64, block_k)
    if m <= 16:
        return 16, 64, bk, 4
    return 64, 64, bk, 8


def _launch(
    kernel: Any, x: torch.Tensor, n: int, weights: Sequence[torch.Tensor], block_k: int, **constexprs: Any
) -> torch.Tensor:
    """``x [M, K]`` through ``kernel`` over the weight tensors -> ``[M, n]`` in ``x``'s dtype."""
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps = choose_tiles(m, block_k)
    kernel[(cdiv(m, bm), cdiv(n, bn))](
        x,
        *weights,
        out,
        m,
        n,
        k,
        x.stride(0),
        *(w.stride(0) for w in weights),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE_DOT=x.dtype == torch.float32,
        num_warps=warps,
        **constexprs,
    )
    return out


def w4a16_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x [M, K]`` times the int4 weight ``[N, K]`` transposed -> ``[M, N]`` in ``x``'s dtype."""
    k, n = x.shape[1], qweight.shape[0]
    assert qweight.dtype == torch.int32 and qweight.shape[1] * 8 == k
    assert k % group_size == 0 and group_size % 16 == 0, "groups of a multiple of 16 inputs tiling K"
    assert scales.shape == zeros.shape == (n, k // group_size)
    return _launch(_w4a16_gemm_kernel, x, n, (qweight, scales, zeros), group_size, GROUP_SIZE=group_size)


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    DECODE_E4M3: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    scale_rows = scale_ptr + (offs_n // SCALE_BLOCK_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0
        )
        # The launcher keeps a K tile inside one scale block.
        scale = tl.load(scale_rows + k0 // SCALE_BLOCK_K, mask=mask_n, other=0.0)
        if DECODE_E4M3:  # noqa: SIM108 - a constexpr branch, compiled out by Triton
            w = e4m3_to_float(w)
        else:
            w = w.to(tl.float32)
        w = (w * scale[:, None]).to(x.dtype)
        if IEEE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])


def fp8_block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    decode_e4m3: bool | None = None,
) -> torch.Tensor:
    """``x [M, K]`` times the e4m3 ``weight [N, K]`` transposed, scaled per ``block`` (``scale``
    [ceil(N / block[0]), ceil(K / block[1])]) or, with ``block=None``, by the one ``scale``.
    ``decode_e4m3`` decodes the bytes in arithmetic (by default on GPUs before sm_89)."""
    k, n = x.shape[1], weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == k
    if block is None:
        assert scale.numel() == 1
        block = (cdiv(n, 64) * 64, cdiv(k, 64) * 64)  # one block over the whole weight
        scale = scale.reshape(1, 1)
    assert scale.shape == (cdiv(n, block[0]), cdiv(k, block[1]))
    assert block[1] % 16 == 0 and (block[1] <= 64 or block[1] % 64 == 0), "K tiles must not straddle scale blocks"
    scale = scale.to(torch.float32).contiguous()
    decode = e4m3_in_arithmetic(x.device) if decode_e4m3 is None else decode_e4m3
    return _launch(
        _fp8_block_gemm_kernel,
        x,
        n,
        (weight.view(torch.uint8) if decode else weight, scale),
        block[1],
        SCALE_BLOCK_N=block[0],
        SCALE_BLOCK_K=block[1],
        DECODE_E4M3=decode,
    )


@triton.jit
def _q8_0_gemm_kernel(
    x_ptr,
    qs_ptr,
    d_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_dn,
    stride_om,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        q = tl.load(qs_ptr + offs_n[:, None] * stride_qn + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0)
        # BLOCK_K is one Q8_0 block (32 inputs): one scale per row.
        d = tl.load(d_ptr + offs_n * stride_dn + k0 // 32, mask=mask_n, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * d[:, None]).to(x.dtype)
        if IEEE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])


def q8_0_gemm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` times the Q8_0 weight (``split_q8_0``'s ``qs [N, K]``, ``d [N, K / 32]``) transposed."""
    k, n = x.shape[1], qs.shape[0]
    assert qs.dtype == torch.int8 and qs.shape[1] == k and k % Q8_0_BLOCK == 0
    assert d.shape == (n, k // Q8_0_BLOCK)
    return _launch(_q8_0_gemm_kernel, x, n, (qs, d), Q8_0_BLOCK)


@triton.jit
def _q4_k_scale_min(row_ptr, sub, mask):
    """The 6-bit scale and min of sub-block ``sub`` (0..7) of each row's 12 packed bytes
    (llama.cpp's ``get_scale_min_k4``): the first four whole in the low 6 bits of bytes 0-3 and
    4-7, the last four as the low and high nibbles of bytes 8-11 with their top two bits
    taken from the high bits of bytes 0-3 and 4-7."""
    b_sub = tl.load(row_ptr + sub, mask=mask, other=0).to(tl.int32)
    b_plus4 = tl.load(row_ptr + sub + 4, mask=mask, other=0).to(tl.int32)
    b_low = tl.load(row_ptr + sub % 4, mask=mask, other=0).to(tl.int32)
    first = sub < 4
    scale = tl.where(first, b_sub & 63, (b_plus4 & 15) | ((b_low >> 6) << 4))
    min_ = tl.where(first, b_plus4 & 63, (b_plus4 >> 4) | ((b_sub >> 6) << 4))
    return scale.to(tl.float32), min_.to(tl.float32)


@triton.jit
def _q4_k_gemm_kernel(
    x_ptr,
    qs_ptr,
    scales_ptr,
    d_ptr,
    dmin_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_scn,
    stride_dn,
    stride_dminn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    # A K tile is one 64-input chunk of a super-block: 32 bytes a row, whose low nibbles are
    # sub-block 2j's 32 values and whose high nibbles are sub-block 2j+1's.
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_rows = x_ptr + offs_m[:, None] * stride_xm + k0 + offs_h[None, :]
        x_lo = tl.load(x_rows, mask=mask_m[:, None], other=0.0)
        x_hi = tl.load(x_rows + HALF, mask=mask_m[:, None], other=0.0)
        nibbles = tl.load(
            qs_ptr + offs_n[:, None] * stride_qn + k0 // 2 + offs_h[None, :], mask=mask_n[:, None], other=0
        ).to(tl.int32)
        block = k0 // 256
        sub = (k0 % 256) // 32
        d = tl.load(d_ptr + offs_n * stride_dn + block, mask=mask_n, other=0.0).to(tl.float32)
        dmin = tl.load(dmin_ptr + offs_n * stride_dminn + block, mask=mask_n, other=0.0).to(tl.float32)
        scale_row = scales_ptr + offs_n * stride_scn + block * 12
        sc_lo, m_lo = _q4_k_scale_min(scale_row, sub, mask_n)
        sc_hi, m_hi = _q4_k_scale_min(scale_row, sub + 1, mask_n)
        w_lo = ((d * sc_lo)[:, None] * (nibbles & 15).to(tl.float32) - (dmin * m_lo)[:, None]).to(x_lo.dtype)
        w_hi = ((d * sc_hi)[:, None] * (nibbles >> 4).to(tl.float32) - (dmin * m_hi)[:, None]).to(x_hi.dtype)
        if IEEE_DOT:
            acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo))
            acc += tl.dot(x_hi, tl.trans(w_hi))
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])


def q4_k_gemm(
    x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """``x [M, K]`` times the Q4_K weight (``split_q4_k``'s parts) transposed -> ``[M, N]``."""
    k, n = x.shape[1], qs.shape[0]
    blocks = k // Q4_K_BLOCK
    assert qs.dtype == scales.dtype == torch.uint8 and k % Q4_K_BLOCK == 0 and qs.shape == (n, k // 2)
    assert scales.shape == (n, blocks * Q4_K_SCALE_BYTES) and d.shape == dmin.shape == (n, blocks)
    return _launch(_q4_k_gemm_kernel, x, n, (qs, scales, d, dmin), 64)
