"""Shared builders and the oracle for the kernel tests."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"
# The interpreter computes bf16 arithmetic wrongly: bf16 only on a real GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

# The project's pure-torch reference is the oracle.
from kernels.reference import paged_attention as ref_paged_attention  # noqa: E402
from kernels.reference import write_kv_cache as ref_write_kv_cache  # noqa: E402,F401


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    max_query_len: int
    max_seq_len: int

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale, self.max_query_len, self.max_seq_len)


def make_batch(
    reqs: list[tuple[int, int]],
    *,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    shared_prefix_blocks: int = 0,
    seed: int = 0,
) -> Batch:
    """A batch of requests given as ``(cached_tokens, query_tokens)``.

    Block 0 of the cache is never allocated: unused block-table entries point at it and
    it, like every unused slot (including the tail of each last block), holds NaN, so a
    read of anything outside the context shows up as NaN in the output.
    ``shared_prefix_blocks``: every request's first blocks are the same physical blocks
    (their contents are written once, from request 0, as prefix caching would).
    """
    gen = torch.Generator().manual_seed(seed)
    nreq = len(reqs)
    seq_lens = [c + n for c, n in reqs]
    nblk = [-(-L // block_size) for L in seq_lens]
    max_blocks = max(nblk) + 1
    total = 1 + shared_prefix_blocks + sum(nblk)
    k_cache = torch.full((total, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    perm = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    shared = [perm.pop() for _ in range(shared_prefix_blocks)]
    block_tables = torch.zeros((nreq, max_blocks), dtype=torch.int32)
    written_shared = set()
    for b, L in enumerate(seq_lens):
        blocks = []
        for j in range(nblk[b]):
            if j < shared_prefix_blocks:
                assert reqs[b][0] >= (j + 1) * block_size, "shared blocks must be full & cached"
                blocks.append(shared[j])
            else:
                blocks.append(perm.pop())
        block_tables[b, : nblk[b]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn((L, num_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((L, num_kv_heads, head_dim), generator=gen).to(dtype)
        for p in range(L):
            blk = blocks[p // block_size]
            if p // block_size < shared_prefix_blocks:
                if blk in written_shared and b > 0:
                    continue
            k_cache[blk, p % block_size] = k[p]
            v_cache[blk, p % block_size] = v[p]
        written_shared.update(blocks[:shared_prefix_blocks])
    q_lens = [n for _, n in reqs]
    qsl = torch.zeros(nreq + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn((sum(q_lens), num_kv_heads * group, head_dim), generator=gen).to(dtype)
    dev = DEVICE
    return Batch(
        q=q.to(dev), k_cache=k_cache.to(dev), v_cache=v_cache.to(dev),
        block_tables=block_tables.to(dev), query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
        scale=head_dim ** -0.5, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )


def reference_attention(batch: Batch) -> torch.Tensor:
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in batch.args()]
    return ref_paged_attention(*args)
