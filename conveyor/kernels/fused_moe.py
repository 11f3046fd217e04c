"""Fused mixture-of-experts feed-forward for the GPU: a Triton grouped GEMM over every expert.
Same signature and numerics as ``conveyor.kernels.reference.fused_moe``.

The steps, all on the device and none reading a value back to the host (so an MoE decode
step can be captured in a CUDA graph):

1. ``align_assignments``: the ``tokens * k`` (token, expert) assignments sorted by expert,
   each expert's run padded up to a multiple of ``BLOCK_M`` so that every ``BLOCK_M`` block
   of the sorted list belongs to one expert. The grid is sized for the worst case
   (``tokens * k + experts * (BLOCK_M - 1)`` rows), a shape the host knows without looking
   at the routing; blocks past the real end are marked expert ``-1`` and exit at once.
2. One launch for gate/up: block ``m`` multiplies its rows of ``x`` (gathered by token) by
   its expert's gate and up rows of ``w13``, and applies the activation in the epilogue, so
   the ``[rows, 2 * inter]`` gate/up product is never written out.
3. One launch for down: the activations times ``w2[e]^T``, each row scaled by its routing
   weight and stored at its assignment's row of a ``[tokens, k, hidden]`` output.
4. The sum over the top-k (``torch.sum``), as the reference does it.

Variants, each a compile-time constant of the same two kernels:
- the activation (``ACTIVATION``): SiLU-and-mul over gate rows then up rows (Mixtral, Qwen),
  or gpt-oss's clamped SwiGLU (``conveyor.kernels.reference.ClampedSwiGLU``) over interleaved rows;
- the experts' biases (``HAS_BIAS``), added to each projection in the epilogue (gpt-oss);
- the weights' format (``W_MXFP4``): dense in any strides (gpt-oss's ``[experts, in, out]``
  read through a transposed view, never copied), or MXFP4 (``Mxfp4Weight``: e2m1 codes, two a
  byte, with an e8m0 scale per 32 inputs), decoded inside the K loop (each step's bytes as
  the even and the odd inputs, two half-depth dots), so the experts stay at 4.25 bits a weight.

Tiles (chosen for an H100, and tuned when one is lent): ``BLOCK_M`` 16 for decode-sized
batches (a few assignments per expert: a larger block would be mostly padding) and 64 for
prefill; ``BLOCK_N`` 64 (the gate/up kernel keeps two accumulators, gate and up, so it
covers 128 of the ``2 * inter`` columns), ``BLOCK_K`` 64, 4 warps, 3 pipeline stages; in
float32 (full-precision dots, no tensor cores) ``BLOCK_N``/``BLOCK_K`` 32, 8 warps, 2 stages.
gpt-oss's variants take 32-deep steps on 64-row tiles (its longer epilogue and the MXFP4
decoding spill on an A100 with 64). ``tests/kernels/test_gpu_compile.py`` compiles each for
sm_90 and sm_80 and checks that none spills registers.

Importing this module imports Triton (see ``conveyor.kernels.triton_ops`` on the interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .reference import ClampedSwiGLU, Mxfp4Weight
from .utils import cdiv


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Below this many assignments per expert on average a 64-row block is mostly padding.
_SMALL_BATCH_ROWS_PER_EXPERT = 16


# The shortest K step an MXFP4 kernel takes: two dots of half its length, each at least 16 long.
MXFP4_MIN_BLOCK_K = 32


def choose_tiles(
    num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype = torch.bfloat16, gpt_oss: bool = False
) -> MoETiles:
    """Tile sizes from the batch's shape alone (never from its routing, which lives on the
    device): the same for every step with the same token count, as a CUDA graph needs.
    ``gpt_oss``: the clamped SwiGLU with biases, or MXFP4 weights decoded in the K loop."""
    rows_per_expert = num_tokens * top_k / num_experts
    block_m = 16 if rows_per_expert <= _SMALL_BATCH_ROWS_PER_EXPERT else 64
    if dtype == torch.float32:
        # Full-precision fp32 dots run on the FMA units with their operands in registers:
        # 64-wide tiles (or 32-wide on 4 warps) spill on an A100; 32-wide on 8 warps do not.
        return MoETiles(block_m=block_m, block_n=32, block_k=32, num_warps=8, num_stages=2)
    # gpt-oss's longer epilogue and the MXFP4 decoding (two half-width dots a step) spill on
    # an A100 with 64-row, 64-deep steps; 32-deep ones do not.
    block_k = 32 if gpt_oss and block_m == 64 else 64
    return MoETiles(block_m=block_m, block_n=64, block_k=block_k, num_warps=4, num_stages=3)


@dataclass(frozen=True)
class Alignment:
    """The sorted, padded assignments: ``sorted_ids[r]`` is the assignment (``token * k +
    choice``) at padded row ``r``, or ``tokens * k`` for a padding row; ``block_expert[b]``
    is the expert of rows ``b * block_m ..``, or ``-1`` past the last expert's run."""

    sorted_ids: torch.Tensor  # int32 [max_rows]
    block_expert: torch.Tensor  # int32 [max_rows // block_m]
    block_m: int


def align_assignments(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the assignments by expert and pad each expert's run to ``block_m``, on the
    device. Within an expert the assignments keep their order (a stable sort)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    max_rows = cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    # scatter_add_, not bincount: bincount on CUDA reads the largest id back to the host.
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=device) - start[expert]
    sorted_ids = torch.full((max_rows,), n, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert] + rank] = order.to(torch.int32)
    block_first_row = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return Alignment(sorted_ids=sorted_ids, block_expert=block_expert, block_m=block_m)


@triton.jit
def _dot(a, b, acc, IEEE_DOT: tl.constexpr):
    # fp32 inputs: full precision, not TF32 (IEEE_DOT is a constexpr: one branch is compiled)
    if IEEE_DOT:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _round(v, dtype: tl.constexpr):
    """``v`` rounded to the activation dtype, back in float32 (as each torch op rounds)."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32: magnitudes 0, 0.5, then ``2 ** (e - 1) * (1 + m / 2)``
    built as float32 bits; bit 3 the sign."""
    mag = code & 7
    bits = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    value = tl.where(mag >= 2, bits.to(tl.float32, bitcast=True), 0.5 * mag.to(tl.float32))
    return tl.where(code >= 8, -value, value)


@triton.jit
def _mxfp4_pair(byte_ptrs, scale_ptrs, mask, dtype: tl.constexpr):
    """A tile of MXFP4 bytes -> (even inputs, odd inputs) in ``dtype``: each byte's low then
    high nibble times its group's ``2 ** (scale - 127)`` (the e8m0 byte shifted into a float32
    exponent). Exact in float32 and bfloat16."""
    packed = tl.load(byte_ptrs, mask=mask, other=0).to(tl.int32)
    scale = (tl.load(scale_ptrs, mask=mask, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return (_e2m1(packed & 15) * scale).to(dtype), (_e2m1(packed >> 4) * scale).to(dtype)


@triton.jit
def _expert_matmul(
    a_ptrs,
    a_mask,
    w_base,
    s_base,
    w_rows,
    w_ok,
    k_len,
    stride_wn,
    stride_wk,
    stride_sn,
    acc,
    BLOCK_K: tl.constexpr,
    W_MXFP4: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """``acc += a[:, :k_len] @ W[w_rows, :k_len].T`` for one expert: ``a_ptrs`` the
    ``[BLOCK_M, 1]`` row starts of ``a`` (unit stride along K); ``W`` dense (``stride_wn``,
    ``stride_wk``) or MXFP4 (bytes at ``w_base``, scales at ``s_base``), dequantized here."""
    dtype = a_ptrs.dtype.element_ty
    if W_MXFP4:
        # Each step takes BLOCK_K inputs as BLOCK_K / 2 bytes: the even inputs of ``a`` meet
        # the low nibbles, the odd ones the high nibbles, in two dots.
        offs_b = tl.arange(0, BLOCK_K // 2)
        for k0 in range(0, k_len, BLOCK_K):
            k_even = k0 + 2 * offs_b
            k_ok = k_even < k_len
            w_mask = k_ok[:, None] & w_ok[None, :]
            byte_ptrs = w_base + w_rows[None, :] * stride_wn + (k0 // 2 + offs_b)[:, None]
            scale_ptrs = s_base + w_rows[None, :] * stride_sn + (k_even // 32)[:, None]
            w_even, w_odd = _mxfp4_pair(byte_ptrs, scale_ptrs, w_mask, dtype)
            a_even = tl.load(a_ptrs + k_even[None, :], mask=a_mask & k_ok[None, :], other=0.0)
            a_odd = tl.load(a_ptrs + k_even[None, :] + 1, mask=a_mask & k_ok[None, :], other=0.0)
            acc = _dot(a_even, w_even, acc, IEEE_DOT)
            acc = _dot(a_odd, w_odd, acc, IEEE_DOT)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_base + w_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk
        for k0 in range(0, k_len, BLOCK_K):
            k_ok = offs_k + k0 < k_len
            a = tl.load(a_ptrs + (k0 + offs_k)[None, :], mask=a_mask & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & w_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, IEEE_DOT)
            w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    w13_scales_ptr,
    b13_ptr,
    act_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_assignments,
    inter,
    hidden,
    alpha,
    limit,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_ar,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_MXFP4: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """``ACTIVATION`` 0: SiLU-and-mul, gate rows ``j``, up rows ``inter + j``; 1: gpt-oss's
    clamped SwiGLU, gate rows ``2 * j``, up rows ``2 * j + 1`` (``alpha``, ``limit``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + rows)
    valid = assignment < num_assignments
    token = (assignment // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    if ACTIVATION == 1:
        gate_rows = 2 * cols
        up_rows = gate_rows + 1
    else:
        gate_rows = cols
        up_rows = cols + inter

    x_ptrs = x_ptr + token[:, None] * stride_xt
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    s_base = w13_scales_ptr + expert.to(tl.int64) * stride_se
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gate = _expert_matmul(
        x_ptrs,
        valid[:, None],
        w_base,
        s_base,
        gate_rows,
        col_ok,
        hidden,
        stride_wn,
        stride_wk,
        stride_sn,
        zeros,
        BLOCK_K,
        W_MXFP4,
        IEEE_DOT,
    )
    up = _expert_matmul(
        x_ptrs,
        valid[:, None],
        w_base,
        s_base,
        up_rows,
        col_ok,
        hidden,
        stride_wn,
        stride_wk,
        stride_sn,
        zeros,
        BLOCK_K,
        W_MXFP4,
        IEEE_DOT,
    )

    # As the reference: the projection rounds to the activation dtype, its bias is added
    # (rounding again), then the activation, rounding after each operation.
    dtype = act_ptr.dtype.element_ty
    gate = _round(gate, dtype)
    up = _round(up, dtype)
    if HAS_BIAS:
        b_base = b13_ptr + expert.to(tl.int64) * stride_be
        gate = _round(gate + tl.load(b_base + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :], dtype)
        up = _round(up + tl.load(b_base + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :], dtype)
    if ACTIVATION == 1:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = _round(1.0 / (1.0 + tl.exp(-_round(gate * alpha, dtype))), dtype)
        act = _round(up + 1.0, dtype) * _round(gate * sig, dtype)
    else:
        act = _round(gate / (1.0 + tl.exp(-gate)), dtype) * up
    act_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_ar + cols[None, :]
    tl.store(act_ptrs, act.to(dtype), mask=col_ok[None, :])


@triton.jit
def _down_weighted_kernel(
    act_ptr,
    w2_ptr,
    w2_scales_ptr,
    b2_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_assignments,
    hidden,
    inter,
    stride_ar,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_or,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_MXFP4: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + rows)
    valid = assignment < num_assignments
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden

    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_ar
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    s_base = w2_scales_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _expert_matmul(
        a_ptrs,
        rows[:, None] >= 0,
        w_base,
        s_base,
        cols,
        col_ok,
        inter,
        stride_wn,
        stride_wk,
        stride_sn,
        acc,
        BLOCK_K,
        W_MXFP4,
        IEEE_DOT,
    )

    dtype = out_ptr.dtype.element_ty
    weight = tl.load(topk_weights_ptr + assignment, mask=valid, other=0.0).to(tl.float32)
    # The weight multiplies the rounded projection (plus its rounded bias), in float32 (the
    # reference computes it in the routing weight's dtype, which is float32 or the activation
    # dtype: the same value rounded once at the end).
    out = _round(acc, dtype)
    if HAS_BIAS:
        bias = tl.load(b2_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = _round(out + bias[None, :], dtype)
    out = out * weight[:, None]
    out_ptrs = out_ptr + assignment[:, None].to(tl.int64) * stride_or + cols[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=valid[:, None] & col_ok[None, :])


ExpertWeight = torch.Tensor | Mxfp4Weight


def _weight_args(w: ExpertWeight) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], bool]:
    """(the tensor, its scales or itself as a placeholder, strides (expert, row, input, scale
    expert, scale row), MXFP4?) of an expert weight, read in place: no copy, so a captured
    graph reads the model's own weights."""
    if isinstance(w, Mxfp4Weight):
        if w.blocks.stride(-1) != 1 or w.scales.stride(-1) != 1:
            raise ValueError("MXFP4 blocks and scales must be contiguous along the inputs")
        strides = (w.blocks.stride(0), w.blocks.stride(1), 1, w.scales.stride(0), w.scales.stride(1))
        return w.blocks, w.scales, strides, True
    return w, w, (w.stride(0), w.stride(1), w.stride(2), 0, 0), False


def fused_moe(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoETiles | None = None,
    activation: ClampedSwiGLU | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [tokens, hidden]``, ``w13 [experts, 2 * inter, hidden]``, ``w2 [experts, hidden,
    inter]`` (any strides, or ``Mxfp4Weight``), ``topk_weights``/``topk_ids [tokens, k]``,
    the optional ``activation`` and biases as ``conveyor.kernels.reference.fused_moe`` -> ``[tokens, hidden]``."""
    tokens, hidden = x.shape
    num_experts, two_inter, w13_hidden = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if w13_hidden != hidden or two_inter != 2 * inter:
        raise ValueError(f"w13 {tuple(w13.shape)} does not fit x {tuple(x.shape)}: want [experts, 2 * inter, {hidden}]")
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"w2 {tuple(w2.shape)} should be [{num_experts}, {hidden}, {inter}] for w13 {tuple(w13.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != tokens:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
            f"should both be [{tokens}, k]"
        )
    if (b13 is None) != (b2 is None):
        raise ValueError("the experts' biases come in pairs: b13 and b2, or neither")
    if b13 is not None and b2 is not None:
        if tuple(b13.shape) != (num_experts, two_inter) or tuple(b2.shape) != (num_experts, hidden):
            raise ValueError(
                f"biases {tuple(b13.shape)} and {tuple(b2.shape)} should be "
                f"[{num_experts}, {two_inter}] and [{num_experts}, {hidden}]"
            )
        if b13.stride(-1) != 1 or b2.stride(-1) != 1:
            raise ValueError("the experts' biases must be contiguous along their last dim")
    out = torch.empty((tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out.sum(dim=1)
    w13_t, w13_s, w13_strides, w13_fp4 = _weight_args(w13)
    w2_t, w2_s, w2_strides, w2_fp4 = _weight_args(w2)
    if w13_fp4 != w2_fp4:
        raise ValueError("w13 and w2 must both be MXFP4 or both dense")
    tiles = tiles or choose_tiles(tokens, top_k, num_experts, x.dtype, activation is not None or w13_fp4)
    if w13_fp4 and tiles.block_k < MXFP4_MIN_BLOCK_K:
        # Each step decodes its bytes into two half-width dots (even and odd inputs), and
        # Triton before 3.7 compiles no dot shorter than 16 (seen on an H200 with 3.6).
        raise ValueError(f"MXFP4 weights need block_k >= {MXFP4_MIN_BLOCK_K}, got {tiles.block_k}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    align = align_assignments(topk_ids, num_experts, tiles.block_m)
    num_blocks = align.block_expert.numel()
    act = torch.empty((num_blocks * tiles.block_m, inter), dtype=x.dtype, device=x.device)
    has_bias = b13 is not None
    common = dict(
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        HAS_BIAS=has_bias,
        W_MXFP4=w13_fp4,
        IEEE_DOT=x.dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    _gate_up_kernel[(num_blocks, cdiv(inter, tiles.block_n))](
        x,
        w13_t,
        w13_s,
        b13 if b13 is not None else x,
        act,
        align.sorted_ids,
        align.block_expert,
        tokens * top_k,
        inter,
        hidden,
        activation.alpha if activation else 0.0,
        activation.limit if activation else 0.0,
        x.stride(0),
        *w13_strides,
        b13.stride(0) if b13 is not None else 0,
        act.stride(0),
        TOP_K=top_k,
        ACTIVATION=1 if activation else 0,
        **common,
    )
    _down_weighted_kernel[(num_blocks, cdiv(hidden, tiles.block_n))](
        act,
        w2_t,
        w2_s,
        b2 if b2 is not None else x,
        out,
        weights,
        align.sorted_ids,
        align.block_expert,
        tokens * top_k,
        hidden,
        inter,
        act.stride(0),
        *w2_strides,
        b2.stride(0) if b2 is not None else 0,
        hidden,
        **common,
    )
    return out.sum(dim=1)
