"""The gated delta rule's Triton kernels (``conveyor.kernels.gated_delta_triton``) against their torch
references (``conveyor.kernels.gated_delta``), in the interpreter on CPU: the decode update and the chunked
prefill, with grouped value heads, states in scattered slots, fresh and continuing sequences,
lengths around the kernel's chunk, and bf16 inputs and outputs (the arithmetic is float32)."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import gated_delta as ref
from conveyor.kernels.gated_delta import l2_normalise
from tests.kernels._helpers import DEVICE, Tol

triton_delta = pytest.importorskip("conveyor.kernels.gated_delta_triton")

TOL = {torch.float32: Tol(atol=1e-4, rtol=1e-4), torch.bfloat16: Tol(atol=2e-2, rtol=2e-2)}


def _inputs(tokens, k_heads, v_heads, dk, dv, dtype, seed, similar_keys=False):
    """Random inputs; ``similar_keys``: keys close to one direction, slow decay and beta near 1,
    where the chunk's triangular system is far from the identity (every term of its inverse
    counts)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalise(torch.randn(tokens, k_heads, dk, generator=gen)) * dk**-0.5
    k = torch.randn(tokens, k_heads, dk, generator=gen)
    if similar_keys:
        k = torch.randn(1, k_heads, dk, generator=gen) + 0.3 * k / dk**0.5
    k = l2_normalise(k)
    v = torch.randn(tokens, v_heads, dv, generator=gen).to(dtype)
    slowness = 0.05 if similar_keys else 1.5
    g = -torch.rand(tokens, v_heads, generator=gen) * slowness  # log decay, float32 as the model's
    beta = torch.rand(tokens, v_heads, generator=gen)
    beta = (0.8 + 0.2 * beta if similar_keys else beta).to(dtype)
    return q, k, v, g, beta


def _states(num_slots, v_heads, dk, dv, seed):
    # Every slot holds a state; a fresh sequence's must be ignored, not read.
    return torch.randn(num_slots, v_heads, dk, dv, generator=torch.Generator().manual_seed(seed))


def _run(fn, tensors, states, *rest, out_dtype):
    out = torch.empty(tensors[2].shape, dtype=out_dtype, device=tensors[0].device)
    fn(*tensors, states, *rest, out)
    return out


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_heads,v_heads,dk,dv", [(2, 4, 32, 16), (1, 2, 128, 128)])
def test_decode_matches_the_reference(dtype, k_heads, v_heads, dk, dv):
    batch = 5
    tensors = _inputs(batch, k_heads, v_heads, dk, dv, dtype, seed=1)
    states = _states(8, v_heads, dk, dv, seed=2)
    slots = torch.tensor([6, 0, 3, 7, 2])
    fresh = torch.tensor([False, True, False, False, True])
    want_states = states.clone()
    want = _run(ref.gated_delta_decode, tensors, want_states, slots, fresh, out_dtype=dtype)
    got_states = states.to(DEVICE)
    got = _run(triton_delta.gated_delta_decode, _on(DEVICE, *tensors), got_states, *_on(DEVICE, slots, fresh),
               out_dtype=dtype)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    torch.testing.assert_close(got_states.cpu(), want_states, **TOL[torch.float32])
    untouched = [1, 4, 5]
    assert torch.equal(got_states.cpu()[untouched], states[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lengths,k_heads,v_heads,dk,dv,similar_keys",
    [([1, 5, 31, 32, 33, 100], 2, 4, 32, 16, False), ([40, 3], 1, 2, 128, 128, False), ([70], 2, 2, 32, 16, True)],
)
def test_prefill_matches_the_reference(dtype, lengths, k_heads, v_heads, dk, dv, similar_keys):
    tensors = _inputs(sum(lengths), k_heads, v_heads, dk, dv, dtype, seed=3, similar_keys=similar_keys)
    states = _states(len(lengths) + 3, v_heads, dk, dv, seed=4)
    slots = torch.randperm(states.shape[0], generator=torch.Generator().manual_seed(5))[: len(lengths)]
    fresh = torch.tensor([i % 2 == 0 for i in range(len(lengths))])
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    want_states = states.clone()
    want = _run(ref.gated_delta_prefill, tensors, want_states, starts, slots, fresh, out_dtype=dtype)
    got_states = states.to(DEVICE)
    got = _run(triton_delta.gated_delta_prefill, _on(DEVICE, *tensors), got_states,
               *_on(DEVICE, starts, slots, fresh), out_dtype=dtype)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    torch.testing.assert_close(got_states.cpu(), want_states, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_snapshots_match_the_reference(dtype):
    """Speculative decoding's snapshots: sequences of at most ``1 + S`` rows (verifications, some
    fresh) leave the state after each of their first rows in snapshot ``position % S`` of their
    slot; a longer prefill and the other slots leave theirs as they were."""
    lengths, num_snapshots, k_heads, v_heads, dk, dv = [5, 2, 40, 4], 4, 2, 4, 32, 16
    tensors = _inputs(sum(lengths), k_heads, v_heads, dk, dv, dtype, seed=9)
    states = _states(6, v_heads, dk, dv, seed=10)
    snapshots = torch.randn(6, num_snapshots, v_heads, dk, dv, generator=torch.Generator().manual_seed(11))
    slots, fresh = torch.tensor([4, 0, 2, 5]), torch.tensor([False, True, False, False])
    positions = torch.tensor([17, 0, 0, 9])
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    want_states, want_snapshots = states.clone(), snapshots.clone()
    want = torch.empty(tensors[2].shape, dtype=dtype)
    q, k, v, g, beta = tensors
    ref.gated_delta_prefill(q, k, v, g, beta, want_states, starts, slots, fresh, want, want_snapshots, positions)
    got_states, got_snapshots = states.to(DEVICE), snapshots.to(DEVICE)
    got = torch.empty(tensors[2].shape, dtype=dtype, device=DEVICE)
    triton_delta.gated_delta_prefill(*_on(DEVICE, *tensors), got_states, *_on(DEVICE, starts, slots, fresh), got,
                                     got_snapshots, positions.to(DEVICE))  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    torch.testing.assert_close(got_states.cpu(), want_states, **TOL[torch.float32])
    torch.testing.assert_close(got_snapshots.cpu(), want_snapshots, **TOL[torch.float32])
    assert not torch.equal(want_snapshots[4], snapshots[4]) and not torch.equal(want_snapshots[0], snapshots[0])
    untouched = [1, 2, 3]  # no sequence, the 40-row prefill, none
    assert torch.equal(got_snapshots.cpu()[untouched], snapshots[untouched])
    assert torch.equal(got_snapshots.cpu()[0, 2:], snapshots[0, 2:])  # 2 rows: snapshots 0 and 1 only


def test_prefill_then_decodes_continue_the_recurrence():
    """A prompt prefilled in two chunks, then three decodes, equal the recurrent form run over
    the whole sequence at once: the slot carries the state between launches."""
    length, k_heads, v_heads, dk, dv = 45, 2, 4, 32, 32
    q, k, v, g, beta = _inputs(length, k_heads, v_heads, dk, dv, torch.float32, seed=6)
    start_state = torch.randn(v_heads, dk, dv, generator=torch.Generator().manual_seed(7))
    want, want_state = ref.gated_delta_rule_recurrent(
        q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1), v, g, beta, start_state
    )
    states = torch.zeros(3, v_heads, dk, dv, device=DEVICE)
    states[1] = start_state.to(DEVICE)
    slot, not_fresh = torch.tensor([1], device=DEVICE), torch.tensor([False], device=DEVICE)
    dq, dk_, dvv, dg, dbeta = _on(DEVICE, q, k, v, g, beta)
    got = torch.empty_like(dvv)
    for lo, hi in ((0, 20), (20, 42)):
        starts = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        triton_delta.gated_delta_prefill(dq[lo:hi], dk_[lo:hi], dvv[lo:hi], dg[lo:hi], dbeta[lo:hi], states,
                                         starts, slot, not_fresh, got[lo:hi])  # fmt: skip
    for t in range(42, length):
        rows = slice(t, t + 1)
        triton_delta.gated_delta_decode(dq[rows], dk_[rows], dvv[rows], dg[rows], dbeta[rows], states, slot,
                                        not_fresh, got[rows])  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[1].cpu(), want_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_matches_the_reference_over_steps(dtype):
    """Three decode steps of the causal conv1d over states in slots (one sequence fresh at the
    first), against ``conveyor.kernels.gated_delta.causal_conv1d_update``; other slots untouched."""
    gen = torch.Generator().manual_seed(8)
    channels, taps, batch = 300, 4, 3  # more channels than one program's block
    weight = torch.randn(channels, taps, generator=gen).to(dtype)
    states = torch.randn(6, channels, taps - 1, generator=gen).to(dtype)
    slots = torch.tensor([4, 1, 2])
    want_states, got_states = states.clone(), states.to(DEVICE)
    for step in range(3):
        x = torch.randn(batch, channels, generator=gen).to(dtype)
        fresh = torch.tensor([step == 0, False, step == 0])
        want = ref.causal_conv1d_update(x, weight, want_states, slots, fresh)
        got = triton_delta.causal_conv1d_update(*_on(DEVICE, x, weight, got_states), *_on(DEVICE, slots, fresh))
        torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
        torch.testing.assert_close(got_states.cpu(), want_states, **TOL[dtype])
    assert torch.equal(got_states.cpu()[[0, 3, 5]], states[[0, 3, 5]])
