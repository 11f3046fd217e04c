"""Triton paged attention: one kernel family for decode, prefill, chunked prefill and
prefill over a cached prefix, plus a split-KV (flash-decoding) variant and its reduction.

Layout (fixed by the engine)::

    q            [num_tokens, num_q_heads, head_dim]    tokens of all requests, no padding
    k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables [num_seqs, max_blocks_per_seq] int32   (unused entries: any value)
    query_start_loc [num_seqs + 1] int32                 cumulative query lengths
    seq_lens     [num_seqs] int32                        context length incl. the new tokens

Query ``i`` of request ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and attends to
keys ``0..position`` (the causal mask is offset by the tokens already in the cache). A
``sliding_window`` of ``W`` keeps the last ``W`` of them (``position - key < W``): key tiles
wholly before a query block's window are not visited. A ``softcap`` of ``c`` turns each
scaled score ``s`` into ``c * tanh(s / c)`` before the softmax (Gemma 2). ``sinks``
(``[num_q_heads]``, gpt-oss) add each head's sink as one more logit to its softmax, with no
value: folded into the running max and sum once, after the last key tile (with key splits, in
the reduction instead, as one more split whose output is zero). All three are compile-time
constants, so a model without them runs the same code as before.

Kernel structure
----------------
One program owns ``(request, block of BLOCK_Q queries, kv head, kv split)``. GQA packing:
the ``G = num_q_heads // num_kv_heads`` query heads that share a kv head are packed with
the query tokens into the ``BLOCK_M = BLOCK_Q * G_PAD`` rows of one tile, so every K/V
tile loaded from the paged cache is used by all of them (read once per kv head, not once
per query head). Keys are walked in tiles of ``TILE_N`` positions; each position's
physical block is gathered from the block table, so ``block_size`` need not be a power of
two nor relate to ``TILE_N``. Online softmax in fp32 (exp2 with the scale folded in).

With ``NUM_SPLITS > 1`` (flash decoding) the keys of each (request, query block) are cut
into ``NUM_SPLITS`` contiguous chunks processed by different programs; each writes a
normalised partial output and its log-sum-exp, and ``_reduce_splits_kernel`` merges them.
The chunk size is computed per request inside the kernel, so a fixed ``NUM_SPLITS`` is
valid for any sequence lengths (CUDA-graph friendly; no host synchronisation anywhere).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .e4m3 import e4m3_in_arithmetic, e4m3_to_float
from .interpreter import is_interpreting
from .utils import cdiv, device_num_sms, next_pow2

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32


@triton.jit
def _paged_attn_kernel(  # noqa: C901  (one Triton program: its branches are compile-time constexpr switches)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    BLOCK_SIZE: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    SOFTCAP: tl.constexpr,  # 0.0: none
    HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,  # 0: the cache holds q's dtype; 1: e4m3; 2: e4m3 bytes, decoded in arithmetic
):
    qb = tl.program_id(0)
    seq = tl.program_id(1)
    pid2 = tl.program_id(2)
    kvh = pid2 // NUM_SPLITS
    split = pid2 % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    # Rows: query token (offs_m // G_PAD) x query head of this kv group (offs_m % G_PAD).
    offs_m = tl.arange(0, BLOCK_M)
    qi = qb * BLOCK_Q + offs_m // G_PAD
    g = offs_m % G_PAD
    head = kvh * G + g
    row_valid = (qi < q_len) & (g < G)
    tok = (q_start + qi).to(tl.int64)
    q_pos = ctx_len + qi

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    if KV_FP8 == 0:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # Keys this query block needs: 0 (or its first query's window start) .. position of its
    # last query (inclusive).
    last_q = tl.minimum(q_len, (qb + 1) * BLOCK_Q) - 1
    kv_end = ctx_len + last_q + 1
    if SLIDING_WINDOW > 0:  # (a compile-time branch: without a window the code is as before)
        kv_start = tl.maximum(ctx_len + qb * BLOCK_Q - (SLIDING_WINDOW - 1), 0)
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE_N) * TILE_N
        lo = kv_start + split * chunk
    else:
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), TILE_N) * TILE_N
        lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    offs_n = tl.arange(0, TILE_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_k = kvh.to(tl.int64) * stride_kh
    kv_head_v = kvh.to(tl.int64) * stride_vh
    for start in range(lo, hi, TILE_N):
        kpos = start + offs_n
        kmask = kpos < hi
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        koff = (kpos % BLOCK_SIZE).to(tl.int64)
        k_addr = blk * stride_kb + koff * stride_ks + kv_head_k
        v_addr = blk * stride_vb + koff * stride_vs + kv_head_v
        kt = tl.load(
            k_cache_ptr + k_addr[None, :] + offs_d[:, None],
            mask=kmask[None, :] & d_mask[:, None],
            other=0.0,
        )
        if KV_FP8 == 1:  # FP8 keys and values are read into q's dtype (a scale of 1)
            kt = kt.to(q.dtype)
        elif KV_FP8 == 2:
            kt = e4m3_to_float(kt).to(q.dtype)
        # fp32 inputs: full precision, not TF32 (IEEE_DOT is a constexpr: one branch is compiled)
        s = tl.dot(q, kt, input_precision="ieee") if IEEE_DOT else tl.dot(q, kt)
        if SOFTCAP > 0.0:
            # c * tanh(x / c) in log2 units, tanh(t) = 1 - 2 / (e^2t + 1) (safe at both ends)
            t = s * (scale_log2e / (SOFTCAP * 1.4426950408889634))
            s = (SOFTCAP * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp2(t * (2.0 * 1.4426950408889634)) + 1.0))
        else:
            s = s * scale_log2e
        keep = (kpos[None, :] <= q_pos[:, None]) & kmask[None, :]
        if SLIDING_WINDOW > 0:
            keep = keep & (kpos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + v_addr[:, None] + offs_d[None, :],
            mask=kmask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if KV_FP8 == 1:
            v = v.to(q.dtype)
        elif KV_FP8 == 2:
            v = e4m3_to_float(v).to(q.dtype)
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee") if IEEE_DOT else tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if HAS_SINKS and NUM_SPLITS == 1:  # (split: the reduction adds the sink, once)
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    st_mask = row_valid[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=st_mask,
        )
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(
            part_out_ptr + tok[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
            o,
            mask=st_mask,
        )
        tl.store(part_lse_ptr + tok * stride_lt + head * stride_lh + split, lse, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    sinks_ptr,
    num_q_heads,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Merge the per-split partial outputs of BLOCK_H query heads of one token:
    out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max) (empty splits: lse = -inf);
    a head's sink is one more term of the denominator."""
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_q_heads
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    hs_mask = h_mask[:, None] & s_mask[None, :]
    lse = tl.load(
        part_lse_ptr + tok * stride_lt + offs_h[:, None] * stride_lh + offs_s[None, :],
        mask=hs_mask,
        other=float("-inf"),
    )  # [BLOCK_H, SPLITS_PAD]
    m = tl.max(lse, 1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + offs_h, mask=h_mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp2(lse - m[:, None])
    o = tl.load(
        part_out_ptr
        + tok * stride_pt
        + offs_h[:, None, None] * stride_ph
        + offs_s[None, :, None] * stride_ps
        + offs_d[None, None, :],
        mask=hs_mask[:, :, None] & d_mask[None, None, :],
        other=0.0,
    )  # [BLOCK_H, SPLITS_PAD, HEAD_DIM_PAD]
    den = tl.sum(w, 1)
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    num = tl.sum(w[:, :, None] * o, 1)
    out = num / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(
        out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & d_mask[None, :],
    )


def _pick_tiles(max_query_len: int, g_pad: int, head_dim_pad: int, elem_size: int = 2, kv_decoded: bool = False):
    """(BLOCK_M, TILE_N, num_warps, num_stages) from the batch shape. A fixed heuristic,
    not autotuning: the choice must be deterministic and capture-safe (CUDA graphs).
    Checked offline (sm_80/86/90 cubins): no register spills for 16-bit caches with head
    dims 64..256 and for fp32 with head dims <= 128; shared memory <= ~100 KB. ``kv_decoded``
    (an FP8 cache decoded in arithmetic, sm_80): query tiles of at most 64 rows (128 spill)."""
    rows = max(1, max_query_len) * g_pad
    if rows <= 16:
        block_m = 16
    elif rows <= 32:
        block_m = 32
    elif rows <= 64:
        block_m = 64
    else:
        block_m = 128 if head_dim_pad <= 128 and not kv_decoded else 64
    if elem_size > 2:  # fp32: the full-precision dot runs on FMA units, keep tiles small
        block_m = max(min(block_m, 32 if head_dim_pad <= 128 else 16), g_pad)
        return block_m, 16, 4, 2
    block_m = max(block_m, g_pad)
    if block_m >= 64:  # prefill-like: compute bound
        tile_n = 64 if head_dim_pad <= 64 else 32
        num_warps = 8 if (block_m >= 128 or head_dim_pad >= 128) else 4
        return block_m, tile_n, num_warps, 2
    # decode-like: bandwidth bound; big key tiles keep many bytes in flight
    tile_n = 64 if head_dim_pad <= 128 else 32
    return block_m, tile_n, 4, (3 if head_dim_pad <= 128 else 2)


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, num_q_blocks: int, max_seq_len: int, tile_n: int, num_sms: int
) -> int:
    """Flash-decoding heuristic: split the keys only when a decode-like batch (one query
    block per request) has too few (request, kv head) programs to fill the GPU."""
    if num_q_blocks != 1:
        return 1
    base = num_seqs * num_kv_heads
    if base >= num_sms:
        return 1
    max_tiles = cdiv(max(max_seq_len, 1), tile_n)
    splits = min(cdiv(2 * num_sms, base), cdiv(max_tiles, 2), _MAX_SPLITS)
    return splits if splits >= 2 else 1


def decode_num_kv_splits(
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_seq_len: int,
    device: torch.device,
) -> int:
    """The key splits ``paged_attention`` would choose for a batch of ``num_seqs`` decodes
    (one query each) with contexts up to ``max_seq_len``. A CUDA graph captures the split
    count with the kernel, so a graph runner pins this, computed for its worst case."""
    g_pad = next_pow2(num_q_heads // num_kv_heads)
    head_dim_pad = max(16, next_pow2(head_dim))
    elem_size = torch.empty((), dtype=dtype).element_size()
    _, tile_n, _, _ = _pick_tiles(1, g_pad, head_dim_pad, elem_size)
    return choose_num_kv_splits(num_seqs, num_kv_heads, 1, max_seq_len, tile_n, device_num_sms(torch.device(device)))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    decode_e4m3: bool | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` over the paged KV cache (see module docstring).

    ``num_kv_splits``: ``None`` chooses automatically (split-KV only for decode-like
    batches that would not fill the GPU); an int forces that many key splits (1 = off).
    ``out``: optional preallocated ``[num_tokens, num_q_heads, head_dim]`` output.
    ``block_m`` / ``tile_n``: override the tile shapes (tests).
    ``sliding_window`` / ``softcap`` / ``sinks``: see the module docstring (None: none).
    An FP8 cache (``torch.float8_e4m3fn``, a scale of 1) is read into ``q``'s dtype, decoded
    in arithmetic on GPUs without the e4m3 type (``decode_e4m3``: by default before sm_89).
    """
    q, block_tables, out = _checked_inputs(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, sliding_window, softcap, sinks
    )
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = block_tables.shape[0]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    decode = fp8 and (e4m3_in_arithmetic(k_cache.device) if decode_e4m3 is None else decode_e4m3)
    if num_tokens == 0 or num_seqs == 0:
        return out

    g = num_q_heads // num_kv_heads
    g_pad = next_pow2(g)
    head_dim_pad = max(16, next_pow2(head_dim))
    bm, tn, num_warps, num_stages = _pick_tiles(max_query_len, g_pad, head_dim_pad, q.element_size(), decode)
    if block_m is not None:
        bm = block_m
    if tile_n is not None:
        tn = tile_n
    bm = max(bm, g_pad)
    block_q = bm // g_pad
    num_q_blocks = cdiv(max(max_query_len, 1), block_q)
    if num_kv_splits is None:
        # (a query block reads at most its window's keys)
        span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_q - 1)
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, num_q_blocks, span, tn, device_num_sms(q.device))
    num_kv_splits = max(1, int(num_kv_splits))
    if is_interpreting():
        num_stages = 1

    if num_kv_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_q_heads, num_kv_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((num_tokens, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = out  # unused by the kernel
        part_lse = out
    grid = (num_q_blocks, num_seqs, num_kv_heads * num_kv_splits)
    _paged_attn_kernel[grid](
        q,
        k_cache.view(torch.uint8) if decode else k_cache,
        v_cache.view(torch.uint8) if decode else v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        part_out,
        part_lse,
        sinks if sinks is not None else out,  # (unread without sinks)
        float(scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if num_kv_splits > 1 else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        BLOCK_SIZE=block_size,
        G=g,
        G_PAD=g_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_Q=block_q,
        BLOCK_M=bm,
        TILE_N=tn,
        NUM_SPLITS=num_kv_splits,
        IEEE_DOT=q.dtype == torch.float32,
        SLIDING_WINDOW=int(sliding_window or 0),
        SOFTCAP=float(softcap or 0.0),
        HAS_SINKS=sinks is not None,
        KV_FP8=2 if decode else int(fp8),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_kv_splits > 1:
        if is_interpreting():  # one program per token: fewer, bigger interpreted steps
            block_h = next_pow2(num_q_heads)
        else:  # enough programs to spread over the SMs, a few heads each when many tokens
            block_h = 1 if num_tokens * num_q_heads <= 4 * device_num_sms(q.device) else 4
        _reduce_splits_kernel[(num_tokens, cdiv(num_q_heads, block_h))](
            part_out,
            part_lse,
            out,
            sinks if sinks is not None else out,
            num_q_heads,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=next_pow2(num_kv_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_H=block_h,
            HAS_SINKS=sinks is not None,
            num_warps=4 if block_h * head_dim_pad >= 256 else 2,
        )
    return out


def _checked_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``paged_attention``'s arguments checked; ``q`` and ``block_tables`` made contiguous along
    their last dim where they are not, and the output (``out``, or a new one)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, head_dim_c = k_cache.shape
    assert head_dim_c == head_dim, (head_dim_c, head_dim)
    assert v_cache.shape == k_cache.shape
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert k_cache.dtype == torch.float8_e4m3fn or q.dtype == k_cache.dtype, (q.dtype, k_cache.dtype)
    assert block_tables.dim() == 2
    num_seqs = block_tables.shape[0]
    assert query_start_loc.shape[0] == num_seqs + 1 and seq_lens.shape[0] == num_seqs
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == (num_tokens, num_q_heads, head_dim) and out.stride(-1) == 1
    if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be a contiguous [{num_q_heads}] tensor, got {tuple(sinks.shape)}")
    return q, block_tables, out
