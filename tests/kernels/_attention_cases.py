"""The attention test grid, shared by the two attention test files (split across files so
that ``pytest -n 2 --dist loadfile`` keeps both workers busy)."""

from __future__ import annotations

import zlib

import pytest
import torch

from ._helpers import DTYPES, TOL, make_batch, reference_attention

# name -> (requests as (cached tokens, new query tokens), block size, shared prefix blocks)
SCENARIOS = {
    # decode: 1-token sequence, block size not dividing, exactly one full block + 1
    "decode": ([(0, 1), (4, 1), (16, 1), (36, 1)], 16, 0),
    # plain prefill, odd block size that divides nothing
    "prefill": ([(0, 1), (0, 7), (0, 19)], 5, 0),
    # prefill over a cached prefix / chunked prefill (causal mask offset by the cache)
    "extend": ([(8, 5), (16, 9), (3, 1)], 4, 0),
    # decode and prefill and extend in one batch
    "mixed": ([(9, 1), (0, 12), (16, 1), (5, 6), (0, 1)], 8, 0),
    # two+ requests whose block tables point at the same prefix blocks
    "shared_prefix": ([(32, 3), (32, 1), (40, 2)], 8, 3),
}

# (num_kv_splits, block_m, tile_n): default tiles; small tiles (several key tiles and
# several query blocks per request); split-KV over small tiles (real merging of splits).
VARIANTS = {
    "single": (1, None, None),
    "single_small": (1, 16, 16),
    "split3_small": (3, 16, 16),
}


def run_case(scenario: str, group: int, head_dim: int, dtype: torch.dtype, variant: str):
    from conveyor.kernels.triton_ops import paged_attention

    reqs, block_size, shared = SCENARIOS[scenario]
    splits, block_m, tile_n = VARIANTS[variant]
    batch = make_batch(
        reqs,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        shared_prefix_blocks=shared,
        seed=zlib.crc32(f"{scenario}-{group}-{head_dim}".encode()),
    )
    out = paged_attention(*batch.args(), num_kv_splits=splits, block_m=block_m, tile_n=tile_n)
    ref = reference_attention(batch)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert not torch.isnan(out).any(), "NaN from an unused cache slot leaked into the output"
    assert not torch.isnan(ref).any()
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])


def _dims_dtypes(group: int):
    """(head_dim, dtype) pairs for one (scenario, group, variant): both head dims and both
    CPU dtypes every time, crossed differently for alternating groups, which halves the
    grid (the interpreter is slow) while every scenario x group x variant still sees fp32,
    fp16, head_dim 64 and 128. bf16 is added only on a real GPU."""
    f32, f16 = torch.float32, torch.float16
    pairs = [(64, f16), (128, f32)] if group in (1, 8) else [(64, f32), (128, f16)]
    if torch.bfloat16 in DTYPES:
        pairs.append((128, torch.bfloat16))
    return pairs


def parametrize(scenarios):
    return pytest.mark.parametrize(
        "scenario,group,head_dim,dtype,variant",
        [
            pytest.param(s, g, d, dt, v, id=f"{s}-G{g}-D{d}-{str(dt)[6:]}-{v}")
            for s in scenarios
            for g in (1, 4, 8)
            for d, dt in _dims_dtypes(g)
            for v in VARIANTS
        ],
    )
