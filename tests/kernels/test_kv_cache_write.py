"""Triton KV-cache write vs the reference."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.reference import write_kv_cache as ref_write_kv_cache

from ._helpers import DEVICE, DTYPES


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    return k_cache, k_cache.clone()


def _check(k, v, slots, k_cache, v_cache):
    from conveyor.kernels.triton_ops import write_kv_cache

    rk, rv = k_cache.cpu().clone(), v_cache.cpu().clone()
    ref_write_kv_cache(k.cpu(), v.cpu(), rk, rv, slots.cpu())
    ret = write_kv_cache(k, v, k_cache, v_cache, slots)  # type: ignore[func-returns-value]  # checked: returns nothing
    assert ret is None
    # exact copy; untouched (NaN) slots stay NaN
    torch.testing.assert_close(k_cache.cpu(), rk, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), rv, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 128), (8, 64), (3, 80)])
@pytest.mark.parametrize("block_size", [5, 16])
def test_write_kv_cache(dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_kv_heads * 1000 + head_dim + block_size)
    num_blocks, num_tokens = 6, 11
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # empty slots: skipped
    k = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    v = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    _check(k, v, slots.to(DEVICE), k_cache, v_cache)
    # the two skipped tokens were written nowhere: exactly 9 token rows are non-NaN
    assert (~torch.isnan(k_cache[..., 0])).sum().item() == (num_tokens - 2) * num_kv_heads


def test_write_kv_cache_strided_views_of_fused_qkv():
    """k and v as column slices of a fused QKV projection output (non-contiguous)."""
    nq, nkv, d, t = 4, 2, 64, 9
    qkv = torch.randn((t, (nq + 2 * nkv) * d), device=DEVICE)
    k = qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d)
    v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
    assert not k.is_contiguous()
    k_cache, v_cache = _caches(4, 4, nkv, d, torch.float32)
    slots = torch.tensor([0, 1, 2, 3, 4, 5, -1, 12, 15], device=DEVICE)
    _check(k, v, slots, k_cache, v_cache)


def test_write_kv_cache_all_skipped_and_empty():
    k_cache, v_cache = _caches(2, 4, 2, 64, torch.float16)
    k = torch.randn((3, 2, 64), device=DEVICE).half()
    _check(k, k.clone(), torch.full((3,), -1, device=DEVICE), k_cache, v_cache)
    assert torch.isnan(k_cache).all()
    _check(k[:0], k[:0], torch.zeros((0,), dtype=torch.int64, device=DEVICE), k_cache, v_cache)


def test_write_kv_cache_int32_slots_and_overwrite():
    k_cache, v_cache = _caches(3, 4, 1, 64, torch.float32)
    k = torch.randn((2, 1, 64), device=DEVICE)
    _check(k, -k, torch.tensor([5, 11], dtype=torch.int32, device=DEVICE), k_cache, v_cache)
    _check(2 * k, k, torch.tensor([11, 0], dtype=torch.int32, device=DEVICE), k_cache, v_cache)
