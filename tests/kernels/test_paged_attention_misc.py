"""Triton paged attention: split-KV edge cases, the split heuristic, odd shapes, strided
inputs, padding rows and chunked-prefill consistency."""

from __future__ import annotations

import pytest
import torch

from ._helpers import DEVICE, TOL, make_batch, reference_attention


def _attn():
    from conveyor.kernels.triton_ops import paged_attention

    return paged_attention


def _check(batch, out):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().float(), reference_attention(batch).float(), **TOL[batch.q.dtype])


@pytest.mark.parametrize("splits,tile_n", [(3, None), (8, 16), (2, 32)])
def test_split_kv_with_empty_splits(splits, tile_n):
    """More splits than key tiles: empty splits must carry no weight in the reduction."""
    batch = make_batch([(0, 1), (20, 1), (40, 1)], group=4, block_size=16, dtype=torch.float16, seed=1)
    _check(batch, _attn()(*batch.args(), num_kv_splits=splits, tile_n=tile_n))


def test_split_kv_long_context_decode():
    batch = make_batch(
        [(199, 1), (95, 1)], num_kv_heads=1, group=8, head_dim=128, block_size=16, dtype=torch.float16, seed=2
    )
    for splits in (1, 4):
        _check(batch, _attn()(*batch.args(), num_kv_splits=splits, tile_n=16))


def test_auto_split_heuristic():
    from conveyor.kernels.triton_ops import choose_num_kv_splits

    # small decode batch on a big GPU: split; big batch or prefill: don't
    assert choose_num_kv_splits(1, 8, 1, 2048, 64, 132) > 1
    assert choose_num_kv_splits(256, 8, 1, 2048, 64, 132) == 1
    assert choose_num_kv_splits(1, 8, 4, 2048, 64, 132) == 1
    assert choose_num_kv_splits(1, 8, 1, 64, 64, 132) == 1  # one key tile: nothing to split
    assert choose_num_kv_splits(1, 1, 1, 1 << 20, 64, 132) <= 32
    # automatic choice end to end (the interpreter assumes 8 SMs: this batch splits)
    batch = make_batch([(60, 1), (33, 1)], num_kv_heads=1, group=4, block_size=16, seed=3)
    assert choose_num_kv_splits(2, 1, 1, batch.max_seq_len, 16, 8) > 1
    _check(batch, _attn()(*batch.args(), tile_n=16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(1, 4, 64), (2, 8, 128), (8, 1, 64)])
def test_decode_split_count_is_what_the_kernel_chooses(monkeypatch, dtype, num_kv_heads, group, head_dim):
    """``decode_num_kv_splits`` (pinned by CUDA graphs) predicts the automatic choice for a
    decode batch, whatever the dtype's tile shapes."""
    import conveyor.kernels.paged_attention as pa
    from conveyor.kernels.triton_ops import decode_num_kv_splits

    chosen: list[int] = []
    choose = pa.choose_num_kv_splits

    def recording_choose(*args: int) -> int:
        chosen.append(choose(*args))
        return chosen[-1]

    monkeypatch.setattr(pa, "choose_num_kv_splits", recording_choose)
    for reqs in ([(60, 1)], [(60, 1), (130, 1)], [(5, 1)] * 4):
        batch = make_batch(reqs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype, seed=9)
        _attn()(*batch.args())
        predicted = decode_num_kv_splits(
            len(reqs), num_kv_heads * group, num_kv_heads, head_dim, dtype, batch.max_seq_len, torch.device(DEVICE)
        )
        assert predicted == chosen[-1], (reqs, predicted, chosen[-1])
    assert any(c > 1 for c in chosen) or num_kv_heads == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("group,head_dim,block_size", [(3, 80, 7), (2, 96, 3), (16, 32, 16)])
@pytest.mark.parametrize("splits", [1, 2])
def test_non_power_of_two_shapes(dtype, group, head_dim, block_size, splits):
    batch = make_batch(
        [(0, 9), (11, 1), (4, 3)],
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=4,
    )
    _check(batch, _attn()(*batch.args(), num_kv_splits=splits, block_m=16, tile_n=16))


def test_strided_q_preallocated_out_and_loose_bounds():
    batch = make_batch([(5, 4), (0, 6), (17, 1)], group=2, head_dim=64, block_size=4, seed=5)
    t, hq, d = batch.q.shape
    fused = torch.zeros((t, hq + 4, d), device=DEVICE)
    fused[:, :hq] = batch.q
    q = fused[:, :hq]  # non-contiguous view (as from a fused QKV projection)
    assert not q.is_contiguous()
    out = torch.full((t, hq, d), float("nan"), device=DEVICE)
    res = _attn()(q, *batch.args()[1:7], batch.max_query_len + 9, batch.max_seq_len + 100, out=out)
    assert res is out
    _check(batch, out)


def test_padding_rows_and_empty_requests():
    """CUDA-graph style padding: a request with seq_len 0 and one query token gives zeros
    (and reads nothing); a request with no query tokens is skipped."""
    batch = make_batch([(6, 2), (0, 1), (9, 1)], group=4, block_size=4, seed=6)
    batch.seq_lens[1] = 0
    batch.block_tables[1] = 0  # points at the NaN block: must not be read
    for splits in (1, 3):
        out = _attn()(*batch.args(), num_kv_splits=splits, tile_n=16)
        assert (out[2] == 0).all()
        _check(batch, out)  # the reference also gives zeros for an empty context
    # an empty request (q_len 0) in the middle of the batch
    b2 = make_batch([(6, 2), (7, 0), (9, 1)], group=4, block_size=4, seed=7)
    assert b2.q.shape[0] == 3
    _check(b2, _attn()(*b2.args()))


def test_chunked_prefill_matches_full_prefill():
    """Prefill in one go == the same prompt in two chunks (second chunk over the cache)."""
    full = make_batch([(0, 21)], num_kv_heads=2, group=4, block_size=8, seed=8)
    out_full = _attn()(*full.args(), block_m=16, tile_n=16)
    for cut in (8, 13):
        qsl = torch.tensor([0, cut], dtype=torch.int32, device=DEVICE)
        first = _attn()(
            full.q[:cut],
            full.k_cache,
            full.v_cache,
            full.block_tables,
            qsl,
            torch.tensor([cut], dtype=torch.int32, device=DEVICE),
            full.scale,
            cut,
            cut,
        )
        qsl = torch.tensor([0, 21 - cut], dtype=torch.int32, device=DEVICE)
        second = _attn()(
            full.q[cut:],
            full.k_cache,
            full.v_cache,
            full.block_tables,
            qsl,
            full.seq_lens,
            full.scale,
            21 - cut,
            21,
            block_m=16,
            tile_n=16,
        )
        torch.testing.assert_close(torch.cat([first, second]), out_full, **TOL[torch.float32])


def test_int64_metadata():
    """The engine may hand int64 block tables / offsets / lengths: same result."""
    batch = make_batch([(3, 2), (0, 5), (12, 1)], group=4, block_size=4, seed=9)
    meta = [batch.block_tables.long(), batch.query_start_loc.long(), batch.seq_lens.long()]
    out = _attn()(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        *meta,
        batch.scale,
        batch.max_query_len,
        batch.max_seq_len,
        num_kv_splits=2,
        tile_n=16,
    )
    _check(batch, out)
