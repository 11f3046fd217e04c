"""Triton multi-head latent attention decode (DeepSeek-V3), computed in the latent space.

Layout and meaning are ``conveyor.kernels.reference.mla_decode``'s::

    q            [num_seqs, num_heads, RANK + ROPE]   absorbed no-rope part, then rope part
    latent_cache [num_blocks, block_size, 1, RANK + ROPE]  per token: latent, then rope key
    block_tables [num_seqs, max_blocks_per_seq] int32
    seq_lens     [num_seqs] int32                    the query is the newest of them
    out          [num_seqs, num_heads, RANK]

Every head reads the same cached rows, so one program owns ``(request, BLOCK_H heads, key
split)``: each tile of ``TILE_N`` cached rows is loaded once and used by all its heads, as a
key (latent and rope parts against the query's) and as a value (the latent part). Online
softmax in float32 with exp2, the scale folded in. With ``NUM_SPLITS > 1`` (a small batch over
long contexts) the keys of a request are cut into contiguous chunks whose normalised partial
outputs and log-sum-exps are merged by ``_merge_splits`` (torch ops on the device, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import cdiv, device_num_sms, next_pow2

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
# Heads per program (the rows of each tile's dot products; 16 is tl.dot's least) and cached
# rows per tile: at DeepSeek-V3's width (512 + 64) these keep the accumulator, the query and
# one tile in registers without spills (tests/kernels/_gpu_compile.py checks sm_90 and sm_80).
BLOCK_H = 16
TILE_N = 16
NUM_WARPS = 4


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2e,
    num_heads,
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_bt,
    stride_os,
    stride_oh,
    stride_osplit,
    BLOCK_SIZE: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    r_ok = r < RANK
    p_ok = p < ROPE
    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_rows + RANK + p[None, :], mask=head_ok[:, None] & p_ok[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for n0 in range(start, end, TILE_N):
        pos = n0 + tl.arange(0, TILE_N)
        pos_ok = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct
        k_lat = tl.load(rows[:, None] + r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(rows[:, None] + RANK + p[None, :], mask=pos_ok[:, None] & p_ok[None, :], other=0.0)
        # fp32 inputs: full precision, not TF32 (IEEE_DOT is a constexpr: one branch is compiled)
        if IEEE_DOT:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(k_lat))
            s += tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(pos_ok[None, :], s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        e = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(e, axis=1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(e.to(k_lat.dtype), k_lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(e.to(k_lat.dtype), k_lat)
        m = m_new

    empty = denom == 0.0  # a split past the end of a short context
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    out_rows = out_ptr + seq * stride_os + split * stride_osplit + heads[:, None] * stride_oh
    tl.store(out_rows + r[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & r_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, denom)))
        tl.store(lse_ptr + (seq * NUM_SPLITS + split) * num_heads + heads, lse, mask=head_ok)


def choose_num_splits(num_seqs: int, num_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split the keys only when the batch has too few (request, head block) programs to fill
    the GPU and the contexts are long enough to share out."""
    base = num_seqs * cdiv(num_heads, BLOCK_H)
    num_sms = device_num_sms(device)
    if base >= num_sms:
        return 1
    splits = min(cdiv(2 * num_sms, base), cdiv(max(max_seq_len, 1), 4 * TILE_N), _MAX_SPLITS)
    return max(splits, 1)


def _merge_splits(parts: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``parts [seqs, splits, heads, RANK]`` normalised partial outputs and ``lse [seqs,
    splits, heads]`` (log2) -> ``[seqs, heads, RANK]``."""
    weights = torch.exp2(lse - lse.amax(dim=1, keepdim=True))  # empty splits: weight 0
    weights = weights / weights.sum(dim=1, keepdim=True)
    return (parts.float() * weights.unsqueeze(-1)).sum(dim=1)


def mla_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``conveyor.kernels.reference.mla_decode`` on the GPU (or in Triton's interpreter).
    ``max_seq_len``: the longest context, for the split choice (without it: no split)."""
    num_seqs, num_heads, width = q.shape
    rope = width - kv_lora_rank
    if latent_cache.shape[-1] != width or latent_cache.shape[2] != 1:
        raise ValueError(f"latent cache {tuple(latent_cache.shape)} does not hold rows of width {width}")
    if q.dtype != latent_cache.dtype:
        q = q.to(latent_cache.dtype)
    q = q.contiguous()
    if num_splits is None:
        num_splits = 1 if max_seq_len is None else choose_num_splits(num_seqs, num_heads, max_seq_len, q.device)
    out_dtype = torch.float32 if num_splits > 1 else q.dtype
    parts = torch.empty((num_seqs, num_splits, num_heads, kv_lora_rank), dtype=out_dtype, device=q.device)
    lse = torch.empty((num_seqs, num_splits, num_heads), dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return parts[:, 0]
    grid = (num_seqs, cdiv(num_heads, BLOCK_H), num_splits)
    _mla_decode_kernel[grid](
        q,
        latent_cache,
        block_tables,
        seq_lens,
        parts,
        lse,
        scale * _LOG2E,
        num_heads,
        q.stride(0),
        q.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        parts.stride(0),
        parts.stride(2),
        parts.stride(1),
        BLOCK_SIZE=latent_cache.shape[1],
        RANK=kv_lora_rank,
        RANK_PAD=max(16, next_pow2(kv_lora_rank)),
        ROPE=rope,
        ROPE_PAD=max(16, next_pow2(rope)),
        BLOCK_H=BLOCK_H,
        TILE_N=TILE_N,
        NUM_SPLITS=num_splits,
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=NUM_WARPS,
    )
    if num_splits == 1:
        return parts[:, 0]
    return _merge_splits(parts, lse).to(q.dtype)
