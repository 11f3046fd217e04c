"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers' own forward pass
(float32): every prompt token's logprob and the top alternatives, under chunked prefill, a
mixed batch, preemption and a warm prefix cache."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.sampling_params import MAX_LOGPROBS
from tests.engine.reference import HFReference

PROMPTS = [
    "The chef will bring the soup to the table",
    "Tip the waiter",
    "A guest asks for the menu and the bill; the waiter brings the menu, then the bill, then the change",
    "Queue worker engine cache block page prompt model output shard job",
]
TOP = 3


@torch.no_grad()
def _hf_prompt_logprobs(hf: HFReference, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position but the last, ``[len - 1, vocab]``."""
    logits = hf.model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _assert_matches_transformers(hf: HFReference, prompt_ids: list[int], entries, top: int) -> None:
    assert entries is not None and len(entries) == len(prompt_ids), "one entry per prompt token"
    assert entries[0] is None, "nothing predicts the first token"
    ref = _hf_prompt_logprobs(hf, prompt_ids)
    for pos in range(1, len(prompt_ids)):
        entry, token = entries[pos], prompt_ids[pos]
        assert token in entry, f"position {pos}: the prompt's own token is missing"
        assert math.isclose(entry[token], float(ref[pos - 1, token]), abs_tol=1e-4), (pos, entry[token])
        want = ref[pos - 1].topk(top)
        ours = sorted((t for t in entry if t != token or t in want.indices.tolist()), key=lambda t: -entry[t])
        assert ours[:top] == want.indices.tolist(), f"position {pos}: top {top} differ"
        assert len(entry) in (top, top + 1)


def test_prompt_logprobs_match_transformers_in_chunks_and_a_mixed_batch(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    hf = hf_reference(path)
    llm = make_llm(path, block_size=4, max_num_batched_tokens=16)
    params = [
        SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=TOP),
        SamplingParams(max_tokens=5, temperature=0),  # beside one that asks for none
        SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=TOP, logprobs=2),
        SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0),
    ]
    outs = llm.generate(PROMPTS, params)
    for out, p in zip(outs, params, strict=True):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        _assert_matches_transformers(hf, out.prompt_token_ids, out.prompt_logprobs, p.prompt_logprobs or 0)
        if p.prompt_logprobs == 0:
            assert all(len(e) == 1 for e in out.prompt_logprobs[1:]), "0: the prompt's own token only"
    assert len(outs[2].logprobs or []) == 5, "sampled-token logprobs still come"


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs_and_only_for_them(tiny_models, make_llm):
    path = tiny_models("llama")
    llm = make_llm(path, block_size=4)
    prompt = PROMPTS[2]
    asks = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    first = llm.generate([prompt], asks)[0]
    again = llm.generate([prompt], asks)[0]
    assert again.num_cached_tokens == 0, "cached tokens have no logits: the prompt is computed"
    assert again.prompt_logprobs == first.prompt_logprobs
    plain = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    assert plain.num_cached_tokens > 0, "a request without prompt logprobs still hits the cache"
    assert plain.token_ids == first.token_ids


def test_preempted_requests_keep_one_entry_per_prompt_token(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    hf = hf_reference(path)
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1)
    llm = make_llm(path, block_size=4, num_kv_blocks=36, max_num_batched_tokens=32)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    for out in outs:
        _assert_matches_transformers(hf, out.prompt_token_ids, out.prompt_logprobs, 1)


def test_n_samples_each_carry_the_prompt_logprobs(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"), block_size=4)
    outs = llm.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=4, seed=3, prompt_logprobs=1))
    assert len(outs) == 2 and outs[0].prompt_logprobs is not None
    assert outs[0].prompt_logprobs == outs[1].prompt_logprobs


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 1.5, True, "2"])
def test_bad_prompt_logprobs_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_the_llm_helper_returns_them_for_token_id_prompts(tiny_models):
    llm = LLM(tiny_models("llama"), dtype="float32", device="cpu")
    ids = [5, 17, 42, 7, 99]
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert out.prompt_token_ids == ids and out.prompt_logprobs is not None
    assert [list(e or {}) for e in out.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
