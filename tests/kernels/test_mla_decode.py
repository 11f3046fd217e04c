"""The Triton MLA decode kernel against the torch reference (``conveyor.kernels.reference.mla_decode``),
in the interpreter on CPU: scattered blocks, contexts of one token to several blocks, head
counts that leave a head block part-full, widths that are not powers of two, split keys."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.mla_decode import mla_decode
from conveyor.kernels.reference import mla_decode as ref_mla_decode
from conveyor.kernels.utils import cdiv
from tests.kernels._helpers import DEVICE, DTYPES, TOL


def _batch(seq_lens, num_heads, rank, rope, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()  # each request's blocks scattered
    tables, used = [], 0
    width = max(blocks_per_seq)
    for n in blocks_per_seq:
        ids = order[used : used + n]
        used += n
        tables.append(ids + [0] * (width - n))
    cache = torch.randn(num_blocks, block_size, 1, rank + rope, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, rank + rope, generator=gen).to(dtype)
    return (
        q.to(DEVICE),
        cache.to(DEVICE),
        torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "rank", "rope", "block_size", "splits"),
    [
        ([1, 17, 40, 5], 4, 32, 8, 16, 1),  # one token to several blocks; fewer heads than a head block
        ([33, 2, 64], 20, 32, 8, 16, 1),  # a second, part-full head block
        ([50, 7], 4, 24, 6, 12, 1),  # widths and block size that are not powers of two
        ([70, 3, 41], 4, 32, 8, 16, 3),  # split keys, one split left empty by a short context
        ([100], 16, 64, 16, 8, 4),
    ],
)
def test_mla_decode_matches_the_reference(seq_lens, num_heads, rank, rope, block_size, splits, dtype):
    q, cache, tables, lens = _batch(seq_lens, num_heads, rank, rope, block_size, dtype)
    scale = (rank + rope) ** -0.5
    want = ref_mla_decode(q, cache, tables, lens, scale, rank)
    got = mla_decode(q, cache, tables, lens, scale, rank, num_splits=splits)
    assert got.shape == (len(seq_lens), num_heads, rank)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_the_split_choice_depends_on_batch_and_length():
    q, cache, tables, lens = _batch([300, 200], 4, 32, 8, 16, torch.float32)
    scale = 40**-0.5
    want = ref_mla_decode(q, cache, tables, lens, scale, 32)
    # (the interpreter's machine counts 8 SMs: two requests of one head block split their keys)
    got = mla_decode(q, cache, tables, lens, scale, 32, max_seq_len=300)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_a_cache_of_another_width_is_refused():
    q, cache, tables, lens = _batch([4], 4, 32, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="width 41"):
        mla_decode(torch.cat((q, q[..., :1]), dim=-1), cache, tables, lens, 1.0, 32)
