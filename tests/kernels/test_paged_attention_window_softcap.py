"""Triton paged attention with a sliding window and attention-logit soft-capping (Gemma 2,
Mistral) against the torch reference, under the interpreter: windows smaller and larger than
the contexts, over decode, prefill, chunked prefill and mixed batches, with and without key
splits."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.reference import paged_attention as ref_paged_attention

from ._helpers import TOL, make_batch

# (cached tokens, new query tokens) per request: decodes, a prefill, prefills over a cache.
REQUESTS = [(30, 1), (0, 21), (13, 9), (3, 1), (40, 5)]


def _run(batch, **kwargs):
    from conveyor.kernels.triton_ops import paged_attention

    return paged_attention(*batch.args(), **kwargs)


def _reference(batch, **kwargs):
    return ref_paged_attention(*batch.cpu().args(), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    "window,softcap,splits,tile_n",
    [
        (8, None, 1, 16),
        (5, None, 3, 16),
        (None, 2.0, 1, None),
        (12, 3.5, 1, 16),
        (7, 1.5, 2, 16),
        (1000, None, 1, None),  # wider than every context: plain causal attention
    ],
    ids=["window8", "window5-split3", "softcap2", "window12-softcap", "window7-softcap-split2", "wide-window"],
)
def test_window_and_softcap_match_the_reference(dtype, window, softcap, splits, tile_n):
    batch = make_batch(REQUESTS, num_kv_heads=2, group=2, head_dim=32, block_size=4, dtype=dtype, seed=7)
    out = _run(batch, num_kv_splits=splits, block_m=16, tile_n=tile_n, sliding_window=window, softcap=softcap)
    ref = _reference(batch, sliding_window=window, softcap=softcap)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])


def test_reference_window_and_softcap_change_the_result():
    """The oracle itself: a window hides old keys and a soft cap bounds the scores, so both
    change the output of a long context (else the tests above would prove nothing)."""
    batch = make_batch([(30, 4)], num_kv_heads=1, group=1, head_dim=16, block_size=8, seed=3).cpu()
    plain = _reference(batch)
    window = _reference(batch, sliding_window=4)
    capped = _reference(batch, softcap=0.5)
    assert not torch.allclose(plain, window) and not torch.allclose(plain, capped)
    # A window of one token: each query sees only its own key, so the output is its value.
    own = _reference(batch, sliding_window=1)
    values = batch.v_cache[batch.block_tables[0, :5].long()].flatten(0, 1)[30:34]
    torch.testing.assert_close(own, values)


@pytest.mark.parametrize("bad", [{"sliding_window": 0}, {"softcap": 0.0}, {"softcap": -1.0}])
def test_bad_window_or_softcap_is_refused(bad):
    batch = make_batch([(0, 2)], seed=0)
    with pytest.raises(ValueError, match="must be positive"):
        _run(batch, **bad)


@pytest.mark.parametrize("splits", [1, 4])
def test_saturated_softcap_matches_the_reference(splits):
    """Scores far beyond the cap (Gemma 2's heads, without q/k norms, reach them): the kernel's
    tanh(t) = 1 - 2 / (e^2t + 1) overflows e^2t to infinity there and must still give +-1."""
    batch = make_batch([(40, 1), (0, 12), (25, 3)], num_kv_heads=2, group=2, head_dim=16, block_size=16, seed=5)
    batch.q.mul_(200.0)  # t = score * scale / cap up to ~100: e^2t overflows float32
    out = _run(batch, num_kv_splits=splits, softcap=8.0, sliding_window=8)
    ref = _reference(batch, softcap=8.0, sliding_window=8)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[torch.float32])
