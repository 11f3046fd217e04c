"""Shared builders and the oracle for the kernel tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypedDict

import torch

from conveyor.kernels.interpreter import kernel_device

# The project's pure-torch reference is the oracle.
from conveyor.kernels.reference import paged_attention as ref_paged_attention
from conveyor.kernels.utils import cdiv


class Tol(TypedDict):
    """Tolerances for ``torch.testing.assert_close``."""

    atol: float
    rtol: float


DEVICE = kernel_device()
# The interpreter computes bf16 arithmetic wrongly: bf16 only on a real GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=1e-4, rtol=1e-4),
    torch.float16: Tol(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tol(atol=2e-2, rtol=2e-2),
}


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

    def args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, int]:
        """The positional arguments of ``paged_attention``."""
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )

    def cpu(self) -> Batch:
        return dataclasses.replace(
            self,
            q=self.q.cpu(),
            k_cache=self.k_cache.cpu(),
            v_cache=self.v_cache.cpu(),
            block_tables=self.block_tables.cpu(),
            query_start_loc=self.query_start_loc.cpu(),
            seq_lens=self.seq_lens.cpu(),
        )


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
    nblk = [cdiv(L, block_size) for L in seq_lens]
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
            if p // block_size < shared_prefix_blocks and blk in written_shared and b > 0:
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
        q=q.to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        block_tables=block_tables.to(dev),
        query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def reference_attention(batch: Batch) -> torch.Tensor:
    return ref_paged_attention(*batch.cpu().args())
