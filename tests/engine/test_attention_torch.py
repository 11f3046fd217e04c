"""The torch attention backend (the CPU path) against the reference oracle, including the
cascade path for decodes that share a long cached prefix."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine import SamplingParams
from conveyor.engine.attention import torch_backend
from conveyor.engine.attention.base import AttentionMetadata
from conveyor.engine.attention.torch_backend import TorchAttention
from conveyor.kernels import reference
from conveyor.kernels.utils import cdiv
from tests.engine.helpers import spy
from tests.engine.reference import assert_outputs_match


def _batch(shared_tokens: int, decode_lens: list[int], prefills: list[tuple[int, int]], *, bs=8, hkv=2, group=2, d=16):
    """A cache where every request's blocks are distinct except the first ``shared_tokens //
    bs`` blocks, which all requests share. Unused blocks hold NaN."""
    torch.manual_seed(0)
    shared = shared_tokens // bs
    lens = decode_lens + [s for _, s in prefills]
    q_lens = [1] * len(decode_lens) + [q for q, _ in prefills]
    num_blocks = shared + sum(cdiv(n, bs) for n in lens) + 4
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks - shared).add(shared).tolist()
    max_blocks = max(cdiv(n, bs) for n in lens)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(lens):
        need = cdiv(n, bs)
        own = [perm.pop() for _ in range(need - min(shared, need))]
        row = list(range(min(shared, need))) + own
        tables[b, :need] = torch.tensor(row)
        k_cache[torch.tensor(row)] = torch.randn(need, bs, hkv, d)  # (shared blocks rewritten alike)
    k_cache[:shared] = torch.randn(shared, bs, hkv, d)
    v_cache[~torch.isnan(k_cache)] = torch.randn(int((~torch.isnan(k_cache)).sum()))
    total = sum(q_lens)
    q = torch.randn(total, hkv * group, d)
    k, v = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
    slots = []
    for b, (ql, n) in enumerate(zip(q_lens, lens, strict=True)):
        for pos in range(n - ql, n):
            slots.append(int(tables[b, pos // bs]) * bs + pos % bs)
    meta = AttentionMetadata.from_host(slots, tables.tolist(), q_lens, lens, len(decode_lens), torch.device("cpu"))
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("shared_tokens", [0, 64, 320])
def test_torch_backend_matches_the_reference(shared_tokens):
    decode_lens = sorted([shared_tokens + n for n in (3, 9, 17, 40, 41, 90)])
    q, k, v, kc, vc, meta = _batch(shared_tokens, decode_lens, prefills=[(5, 5), (7, shared_tokens + 30)])
    oracle_k, oracle_v = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, oracle_k, oracle_v, meta.slot_mapping)
    expected = reference.paged_attention(
        q, oracle_k, oracle_v, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.25
    )
    backend = TorchAttention()
    backend.prepare(meta)
    got = backend.forward(q, k, v, kc, vc, 0.25)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc.nan_to_num(), oracle_k.nan_to_num())
    used_cascade = backend._plans[None][0] is not None
    assert used_cascade == (shared_tokens >= torch_backend.CASCADE_MIN_SHARED_TOKENS)


@pytest.mark.parametrize("window", [None, 24])
def test_sinks_match_the_reference_and_skip_the_cascade(window):
    """gpt-oss's sinks (one more logit per head, no value) in decode buckets and prefills,
    with decodes that share a long prefix: the cascade, which would merge the prefix's partial
    sums without the sink, is not taken."""
    decode_lens = sorted([320 + n for n in (3, 9, 17, 40, 41, 90)])
    q, k, v, kc, vc, meta = _batch(320, decode_lens, prefills=[(5, 5), (7, 350)])
    sinks = torch.randn(4) * 2.0
    oracle_k, oracle_v = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, oracle_k, oracle_v, meta.slot_mapping)
    args = (q, oracle_k, oracle_v, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.25)
    expected = reference.paged_attention(*args, sliding_window=window, sinks=sinks)
    assert not torch.allclose(expected, reference.paged_attention(*args, sliding_window=window))
    backend = TorchAttention()
    backend.prepare(meta)
    got = backend.forward(q, k, v, kc, vc, 0.25, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert backend._plans[window if window is not None else torch_backend.NO_CASCADE][0] is None


@pytest.mark.parametrize("shared_tokens", [0, 320])
@pytest.mark.parametrize("window,softcap", [(8, None), (None, 1.5), (13, 2.0)])
def test_torch_backend_window_and_softcap_match_the_reference(shared_tokens, window, softcap):
    """Decodes (with and without a long shared prefix, where a window turns the cascade
    off), a prefill and a prefill over a cached prefix, each longer than the window."""
    decode_lens = sorted([shared_tokens + n for n in (3, 9, 17, 40, 41, 90)])
    q, k, v, kc, vc, meta = _batch(shared_tokens, decode_lens, prefills=[(20, 20), (7, shared_tokens + 30)])
    oracle_k, oracle_v = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, oracle_k, oracle_v, meta.slot_mapping)
    expected = reference.paged_attention(
        q,
        oracle_k,
        oracle_v,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        0.25,
        sliding_window=window,
        softcap=softcap,
    )
    backend = TorchAttention()
    backend.prepare(meta)
    got = backend.forward(q, k, v, kc, vc, 0.25, sliding_window=window, softcap=softcap)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # A second layer of the same step without a window still gets plain causal attention.
    plain = reference.paged_attention(
        q, oracle_k, oracle_v, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.25
    )
    torch.testing.assert_close(backend.forward(q, k, v, kc, vc, 0.25), plain, rtol=1e-5, atol=1e-5)
    if window is not None:
        shared, buckets = backend._plans[window]
        assert shared is None, "a windowed layer must not use the cascade"
        # Each decode reads only the blocks of 8 tokens its window reaches, however long its context.
        assert all(tables.shape[1] <= cdiv(window, 8) + 1 for _, _, tables, _ in buckets)


def test_cascade_decoding_keeps_outputs_exact(tiny_models, hf_reference, make_llm, monkeypatch):
    path = tiny_models("qwen2")
    hf = hf_reference(path)
    calls = spy(monkeypatch, torch_backend, "_shared_prefix_partials")
    monkeypatch.setattr(torch_backend, "CASCADE_MIN_SHARED_TOKENS", 32)
    llm = make_llm(path, block_size=8)
    system = "Seven guests wait at the table and the waiter pours cold water while the kitchen bakes bread. " * 2
    prompts = [system + q for q in ("Tea?", "Soup and fish", "The bill", "Count to three", "Cake", "Rice")]
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0))  # caches the shared prefix
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    assert calls, "the cascade path did not run"
    assert_outputs_match(hf, prompts, [20] * len(prompts), outs)
