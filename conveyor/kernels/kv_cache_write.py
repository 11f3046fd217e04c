"""Triton kernel: write new K/V rows into the paged KV cache.

Cache layout (per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
An FP8 cache (``torch.float8_e4m3fn``) stores each value rounded to e4m3 with a scale of 1,
through the e4m3 type or, on GPUs without it, encoded in arithmetic into the bytes.
Token ``t`` goes to flat slot ``slot_mapping[t] = block_id * block_size + offset``;
a negative slot means "skip this token" (padding, e.g. CUDA-graph padded decode rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .e4m3 import e4m3_encoded_in_arithmetic, float_to_e4m3
from .utils import next_pow2


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ENCODE_E4M3: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_cb + off * stride_cs
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs
    if ENCODE_E4M3:  # the caches viewed as bytes
        k = float_to_e4m3(k.to(tl.float32))
        v = float_to_e4m3(v.to(tl.float32))
    tl.store(kc + offs_h[:, None] * stride_ch + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    encode_e4m3: bool | None = None,
) -> None:
    """Scatter ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches in place.

    ``k``/``v`` may be strided views (e.g. slices of a fused QKV output) as long as the
    last dimension is contiguous; the caches must have a contiguous last dimension too.
    Values are cast to the cache dtype. Tokens with a negative slot are skipped.
    ``encode_e4m3``: for an FP8 cache, encode in arithmetic (by default on GPUs before sm_89
    and in the interpreter).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (v.shape, k.shape)
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert k_cache.shape[2] == num_kv_heads and k_cache.shape[3] == head_dim
    assert slot_mapping.shape[0] >= num_tokens
    if num_tokens == 0:
        return None
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_size = k_cache.shape[1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    encode = fp8 and (e4m3_encoded_in_arithmetic(k_cache.device) if encode_e4m3 is None else encode_e4m3)
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache.view(torch.uint8) if encode else k_cache,
        v_cache.view(torch.uint8) if encode else v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        ENCODE_E4M3=encode,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
    return None
