"""Triton paged attention with attention sinks (gpt-oss: a learned logit per query head in
every softmax, with no value) against the torch reference, under the interpreter: decode,
prefill, chunked prefill and mixed batches, with and without key splits (where the reduction
adds the sink), alone and with a sliding window; and the reference against transformers'
own eager gpt-oss attention."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.reference import paged_attention as ref_paged_attention

from ._helpers import DEVICE, TOL, make_batch

# (cached tokens, new query tokens) per request: decodes, a prefill, prefills over a cache.
REQUESTS = [(30, 1), (0, 21), (13, 9), (3, 1), (40, 5)]


def _sinks(num_q_heads: int, dtype: torch.dtype, seed: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_q_heads, generator=g) * 2.0).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    "window,splits,tile_n",
    [(None, 1, 16), (None, 3, 16), (8, 1, 16), (5, 2, 16), (None, 1, None)],
    ids=["sinks", "sinks-split3", "window8-sinks", "window5-sinks-split2", "sinks-default-tiles"],
)
def test_sinks_match_the_reference(dtype, window, splits, tile_n):
    from conveyor.kernels.triton_ops import paged_attention

    batch = make_batch(REQUESTS, num_kv_heads=2, group=2, head_dim=32, block_size=4, dtype=dtype, seed=7)
    sinks = _sinks(4, dtype)
    out = paged_attention(
        *batch.args(), num_kv_splits=splits, block_m=16, tile_n=tile_n, sliding_window=window, sinks=sinks.to(DEVICE)
    )
    ref = ref_paged_attention(*batch.cpu().args(), sliding_window=window, sinks=sinks)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])


def test_sinks_of_the_wrong_shape_are_refused():
    from conveyor.kernels.triton_ops import paged_attention

    batch = make_batch([(0, 2)], num_kv_heads=1, group=2, seed=0)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention(*batch.args(), sinks=torch.zeros(3, dtype=batch.q.dtype, device=DEVICE))


class _GptOssAttentionStandIn(torch.nn.Module):
    """What transformers' eager gpt-oss attention reads from its module."""

    def __init__(self, num_key_value_groups: int, sinks: torch.Tensor) -> None:
        super().__init__()
        self.num_key_value_groups = num_key_value_groups
        self.sinks = torch.nn.Parameter(sinks, requires_grad=False)
        self.train(False)


def test_reference_sinks_follow_transformers_eager_attention():
    """The oracle against transformers' own gpt-oss attention over one request: a large sink
    takes weight from every key (the output shrinks), and the values match."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    batch = make_batch([(0, 12)], num_kv_heads=2, group=2, head_dim=16, block_size=4, seed=3).cpu()
    sinks = _sinks(4, torch.float32)
    ours = ref_paged_attention(*batch.args(), sinks=sinks)
    k = batch.k_cache[batch.block_tables[0, :3].long()].flatten(0, 1)[:12]
    v = batch.v_cache[batch.block_tables[0, :3].long()].flatten(0, 1)[:12]
    module = _GptOssAttentionStandIn(num_key_value_groups=2, sinks=sinks)
    mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
    theirs, _ = eager_attention_forward(
        module, batch.q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, batch.scale
    )
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)
    plain = ref_paged_attention(*batch.args())
    assert not torch.allclose(ours, plain)
    drowned = ref_paged_attention(*batch.args(), sinks=torch.full((4,), 60.0))
    assert drowned.abs().max() < 1e-6
