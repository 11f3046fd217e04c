"""The gated delta rule and causal conv1d references (``conveyor.kernels.gated_delta``) against
transformers' own torch implementations, and the chunked form against the recurrent one:
with a carried state, grouped value heads, lengths around the chunk size, and split calls."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from conveyor.kernels import reference
from conveyor.kernels.gated_delta import l2_normalise


def _inputs(length: int, heads: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(length, heads, dk, generator=g), torch.randn(length, heads, dk, generator=g)
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, generator=g) * 2
    beta = torch.rand(length, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 150])
def test_chunked_rule_matches_transformers(length):
    q, k, v, g, beta, state = _inputs(length)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    qn, kn = l2_normalise(q) * q.shape[-1] ** -0.5, l2_normalise(k)
    out, new_state = reference.gated_delta_rule_chunked(qn, kn, v, g, beta, state)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, ref_state[0], atol=1e-5, rtol=1e-5)
    rec, rec_state = reference.gated_delta_rule_recurrent(qn, kn, v, g, beta, state)
    torch.testing.assert_close(rec, out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rec_state, new_state, atol=1e-4, rtol=1e-4)


def test_recurrent_rule_matches_transformers_decode_in_a_batch():
    q, k, v, g, beta, state = _inputs(1, seed=1)
    q2, k2, v2, g2, beta2, state2 = _inputs(1, seed=2)
    batch = [torch.stack(pair) for pair in ((q, q2), (k, k2), (v, v2), (g, g2), (beta, beta2), (state, state2))]
    qb, kb, vb, gb, betab, stateb = batch
    ref, ref_state = hf.torch_recurrent_gated_delta_rule(
        qb, kb, vb, gb, betab, initial_state=stateb, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, new_state = reference.gated_delta_rule_recurrent(
        l2_normalise(qb) * qb.shape[-1] ** -0.5, l2_normalise(kb), vb, gb, betab, stateb
    )
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(new_state, ref_state, atol=1e-6, rtol=1e-5)


def test_chunked_rule_split_anywhere_carries_the_state():
    q, k, v, g, beta, state = _inputs(100, seed=3)
    qn, kn = l2_normalise(q) * q.shape[-1] ** -0.5, l2_normalise(k)
    whole, whole_state = reference.gated_delta_rule_chunked(qn, kn, v, g, beta, state)
    head, mid = reference.gated_delta_rule_chunked(qn[:37], kn[:37], v[:37], g[:37], beta[:37], state)
    tail, end = reference.gated_delta_rule_chunked(qn[37:], kn[37:], v[37:], g[37:], beta[37:], mid)
    torch.testing.assert_close(torch.cat((head, tail)), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, whole_state, atol=1e-5, rtol=1e-5)


def test_causal_conv1d_matches_transformers_across_chunks_and_decodes():
    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(12, 6, generator=g), torch.randn(6, 4, generator=g)
    ref = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    out, state = reference.causal_conv1d(x, weight, torch.zeros(6, 3))
    torch.testing.assert_close(out, ref)
    first, mid = reference.causal_conv1d(x[:5], weight, torch.zeros(6, 3))
    second, mid2 = reference.causal_conv1d(x[5:9], weight, mid)
    step, mid3 = reference.causal_conv1d_decode(x[9:10], weight, mid2[None])
    rest, end = reference.causal_conv1d(x[10:], weight, mid3[0])
    torch.testing.assert_close(torch.cat((first, second, step, rest)), ref)
    torch.testing.assert_close(end, state)
    assert torch.equal(state, x[-3:].t())  # the state is the last K - 1 inputs


def test_snapshots_are_the_states_after_each_row():
    """A verification-sized prefill (at most ``1 + S`` rows) leaves the conv and recurrent states
    after each of its first rows in snapshot ``position % S``; a longer one leaves none."""
    from conveyor.kernels import gated_delta

    num_snapshots, position, heads = 3, 7, 2
    q, k, v, g, beta, state = _inputs(4, heads=heads)
    q, k = l2_normalise(q), l2_normalise(k)
    states = state[None].clone()
    snapshots = torch.full((1, num_snapshots, *state.shape), float("nan"))
    starts, slot, fresh = torch.tensor([0, 4]), torch.tensor([0]), torch.tensor([False])
    out = torch.empty_like(v)
    gated_delta.gated_delta_prefill(q, k, v, g, beta, states, starts, slot, fresh, out, snapshots, torch.tensor([7]))
    for i in range(num_snapshots):
        _, want = reference.gated_delta_rule_recurrent(
            q[: i + 1], k[: i + 1], v[: i + 1], g[: i + 1], beta[: i + 1], state
        )
        torch.testing.assert_close(snapshots[0, (position + i) % num_snapshots], want, atol=1e-5, rtol=1e-5)
    x, conv_state = torch.randn(4, 6), torch.randn(6, 3)
    conv_snapshots = torch.full((1, num_snapshots, 6, 3), float("nan"))
    gated_delta.causal_conv1d_snapshots(x, conv_state, conv_snapshots, 0, position)
    for i in range(num_snapshots):
        _, want = reference.causal_conv1d(x[: i + 1], torch.randn(6, 4), conv_state)
        assert torch.equal(conv_snapshots[0, (position + i) % num_snapshots], want)
    untouched = conv_snapshots.clone()
    gated_delta.causal_conv1d_snapshots(torch.randn(5, 6), conv_state, conv_snapshots, 0, 0)  # 5 > 1 + S rows
    assert torch.equal(untouched.nan_to_num(), conv_snapshots.nan_to_num())
