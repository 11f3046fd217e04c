"""Fused mixture-of-experts feed-forward for the GPU: a Triton grouped GEMM over every expert.
Same signature and numerics as ``kernels.reference.fused_moe``.

The steps, all on the device and none reading a value back to the host (so an MoE decode
step can be captured in a CUDA graph):

1. ``align_assignments``: the ``tokens * k`` (token, expert) assignments sorted by expert,
   each expert's run padded up to a multiple of ``BLOCK_M`` so that every ``BLOCK_M`` block
   of the sorted list belongs to one expert. The grid is sized for the worst case
   (``tokens * k + experts * (BLOCK_M - 1)`` rows), a shape the host knows without looking
   at the routing; blocks past the real end are marked expert ``-1`` and exit at once.
2. One launch for gate/up: block ``m`` multiplies its rows of ``x`` (gathered by token) by
   its expert's gate and up rows of ``w13``, and applies SiLU-and-mul in the epilogue, so the
   ``[rows, 2 * inter]`` gate/up product is never written out.
3. One launch for down: the activations times ``w2[e]^T``, each row scaled by its routing
   weight and stored at its assignment's row of a ``[tokens, k, hidden]`` output.
4. The sum over the top-k (``torch.sum``), as the reference does it.

Tiles (chosen for an H100, and tuned when one is lent): ``BLOCK_M`` 16 for decode-sized
batches (a few assignments per expert: a larger block would be mostly padding) and 64 for
prefill; ``BLOCK_N`` 64 (the gate/up kernel keeps two accumulators, gate and up, so it
covers 128 of the ``2 * inter`` columns), ``BLOCK_K`` 64, 4 warps, 3 pipeline stages; in
float32 (full-precision dots, no tensor cores) ``BLOCK_N``/``BLOCK_K`` 32, 8 warps, 2 stages.
``tests/kernels/test_gpu_compile.py`` compiles each for sm_90 and sm_80 and checks that none
spills registers.

Importing this module imports Triton (see ``kernels.triton_ops`` on the interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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


def choose_tiles(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype = torch.bfloat16) -> MoETiles:
    """Tile sizes from the batch's shape alone (never from its routing, which lives on the
    device): the same for every step with the same token count, as a CUDA graph needs."""
    rows_per_expert = num_tokens * top_k / num_experts
    block_m = 16 if rows_per_expert <= _SMALL_BATCH_ROWS_PER_EXPERT else 64
    if dtype == torch.float32:
        # Full-precision fp32 dots run on the FMA units with their operands in registers:
        # 64-wide tiles (or 32-wide on 4 warps) spill on an A100; 32-wide on 8 warps do not.
        return MoETiles(block_m=block_m, block_n=32, block_k=32, num_warps=8, num_stages=2)
    return MoETiles(block_m=block_m, block_n=64, block_k=64, num_warps=4, num_stages=3)


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
def _gate_up_silu_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_assignments,
    inter,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ar,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    token = (assignment // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_base + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k + k0 < hidden
        xs = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(gate_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        wu = tl.load(up_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        # fp32 inputs: full precision, not TF32 (IEEE_DOT is a constexpr: one branch is compiled)
        if IEEE_DOT:
            gate = tl.dot(xs, wg, gate, input_precision="ieee")
            up = tl.dot(xs, wu, up, input_precision="ieee")
        else:
            gate = tl.dot(xs, wg, gate)
            up = tl.dot(xs, wu, up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K

    # As the reference: the projection rounds to the activation dtype, silu(gate) rounds
    # again, then the product.
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    act_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_ar + cols[None, :]
    tl.store(act_ptrs, act.to(dtype), mask=col_ok[None, :])


@triton.jit
def _down_weighted_kernel(
    act_ptr,
    w2_ptr,
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
    stride_or,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_ar + offs_k[None, :]
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k + k0 < inter
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee") if IEEE_DOT else tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    weight = tl.load(topk_weights_ptr + assignment, mask=valid, other=0.0).to(tl.float32)
    # The weight multiplies the rounded projection, in float32 (the reference computes it in
    # the routing weight's dtype, which is float32 or the activation dtype: the same value
    # rounded once at the end).
    out = acc.to(dtype).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + assignment[:, None].to(tl.int64) * stride_or + cols[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=valid[:, None] & col_ok[None, :])


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoETiles | None = None,
) -> torch.Tensor:
    """``x [tokens, hidden]``, ``w13 [experts, 2 * inter, hidden]``, ``w2 [experts, hidden,
    inter]``, ``topk_weights``/``topk_ids [tokens, k]`` -> ``[tokens, hidden]``."""
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
    out = torch.empty((tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out.sum(dim=1)
    tiles = tiles or choose_tiles(tokens, top_k, num_experts, x.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    align = align_assignments(topk_ids, num_experts, tiles.block_m)
    num_blocks = align.block_expert.numel()
    act = torch.empty((num_blocks * tiles.block_m, inter), dtype=x.dtype, device=x.device)
    _gate_up_silu_kernel[(num_blocks, cdiv(inter, tiles.block_n))](
        x,
        w13,
        act,
        align.sorted_ids,
        align.block_expert,
        tokens * top_k,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOP_K=top_k,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        IEEE_DOT=x.dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    _down_weighted_kernel[(num_blocks, cdiv(hidden, tiles.block_n))](
        act,
        w2,
        out,
        weights,
        align.sorted_ids,
        align.block_expert,
        tokens * top_k,
        hidden,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        hidden,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        IEEE_DOT=x.dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out.sum(dim=1)
