"""Triton GEMMs over quantized weights, dequantized tile by tile in the K loop: ``x @ W.T``
with ``W`` never materialised. Same arithmetic as their references in ``kernels.reference``.

- ``w4a16_gemm``: one packed int4 layout for AWQ, GPTQ and compressed-tensors (each repacks to
  it): ``qweight`` [N, K/8] int32, eight consecutive inputs a word, lowest bits first, unsigned
  0..15; ``scales`` and ``zeros`` [N, K/group] (zeros unsigned, 8 for a symmetric checkpoint);
  ``W[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group]``.
- ``fp8_block_gemm``: e4m3 ``weight`` [N, K] times one float32 scale per ``block`` (128x128 in
  Qwen's and DeepSeek's releases; the edge blocks short), or one scale for the tensor.
  Activations stay in their dtype (W8A16).
- ``q8_0_gemm``: GGUF's Q8_0 kept quantized: per row, blocks of 32 int8 values and their fp16
  scale (``split_q8_0`` takes llama.cpp's 34-byte blocks apart, the same bytes in two tensors);
  ``W[n, k] = qs[n, k] * d[n, k // 32]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .e4m3 import e4m3_in_arithmetic, e4m3_to_float
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


def choose_fp8_tiles(m: int, block_k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)``, the K tile inside one scale block."""
    block = min(64, block_k)
    if m <= 16:
        return 16, 64, block, 4
    return 64, 64, block, 8


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
    m, k = x.shape
    n = weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == k
    if block is None:
        assert scale.numel() == 1
        block = (cdiv(n, 64) * 64, cdiv(k, 64) * 64)  # one block over the whole weight
        scale = scale.reshape(1, 1)
    assert scale.shape == (cdiv(n, block[0]), cdiv(k, block[1]))
    assert block[1] % 16 == 0 and (block[1] <= 64 or block[1] % 64 == 0), "K tiles must not straddle scale blocks"
    x = x.contiguous()
    scale = scale.to(torch.float32).contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps = choose_fp8_tiles(m, block[1])
    decode = e4m3_in_arithmetic(x.device) if decode_e4m3 is None else decode_e4m3
    _fp8_block_gemm_kernel[(cdiv(m, bm), cdiv(n, bn))](
        x,
        weight.view(torch.uint8) if decode else weight,
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        SCALE_BLOCK_N=block[0],
        SCALE_BLOCK_K=block[1],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE_DOT=x.dtype == torch.float32,
        DECODE_E4M3=decode,
        num_warps=warps,
    )
    return out


# GGUF Q8_0: 32 values a block, stored as the fp16 scale then 32 int8s.
Q8_0_BLOCK = 32
Q8_0_BYTES = 2 + Q8_0_BLOCK


def split_q8_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 rows ``[N, K / 32 * 34]`` uint8 -> ``(qs [N, K] int8, d [N, K / 32] fp16)``."""
    n, row_bytes = raw.shape
    assert raw.dtype == torch.uint8 and row_bytes % Q8_0_BYTES == 0
    blocks = raw.reshape(n, row_bytes // Q8_0_BYTES, Q8_0_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, -1)
    qs = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
    return qs, d


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


def choose_q8_0_tiles(m: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)``: K tiles of one Q8_0 block."""
    return (16, 64, Q8_0_BLOCK, 4) if m <= 16 else (64, 64, Q8_0_BLOCK, 4)


def q8_0_gemm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` times the Q8_0 weight (``split_q8_0``'s ``qs [N, K]``, ``d [N, K / 32]``) transposed."""
    m, k = x.shape
    n = qs.shape[0]
    assert qs.dtype == torch.int8 and qs.shape[1] == k and k % Q8_0_BLOCK == 0
    assert d.shape == (n, k // Q8_0_BLOCK)
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps = choose_q8_0_tiles(m)
    _q8_0_gemm_kernel[(cdiv(m, bm), cdiv(n, bn))](
        x,
        qs,
        d,
        out,
        m,
        n,
        k,
        x.stride(0),
        qs.stride(0),
        d.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE_DOT=x.dtype == torch.float32,
        num_warps=warps,
    )
    return out
