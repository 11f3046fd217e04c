"""Speculative decoding: greedy outputs identical to transformers' and to plain decoding with
prompt lookup and with a draft model (mixed batches, chunked prefill, preemption, prefix
caching, stops), the sampled distribution unchanged (chi-square), config validation, and the
KV cache never hashing an unverified token."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from conveyor.engine import LLM, EngineConfig, SamplingParams, StructuredOutputs
from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.memory.kv_cache import KVCacheManager
from conveyor.engine.spec_decode import verifier
from conveyor.engine.spec_decode.config import SpeculativeConfig
from conveyor.engine.spec_decode.ngram import ngram_proposal
from conveyor.testing.tiny_models import build_truncated_draft
from tests.engine.helpers import record_steps
from tests.engine.reference import assert_greedy_match, assert_outputs_match, greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Small weights make a tiny random model fall into loops and repeated phrases, with breaks
# between them: prompt lookup then sees accepted and rejected proposals alike.
LOOPING = {"init_std": 0.02}
PROMPTS = [
    "The chef will bring the soup to the table",
    "Seven eight nine ten, seven eight nine ten, seven eight",
    "Tip the waiter",
    "A guest asks for the menu and the bill; the waiter brings the menu, then the bill, then",
    "Queue worker engine cache block page prompt model output shard job",
]
MAX_TOKENS = [40, 12, 33, 25, 38]


def _spec(stats):
    assert stats.spec_decode is not None
    return stats.spec_decode


def _assert_speculated(llm: LLM, outs, *, rejections: bool = True) -> None:
    stats = _spec(llm.engine.stats())
    assert stats.num_accepted_tokens > 0, "no proposal was ever accepted: speculation was not exercised"
    if rejections:
        assert stats.num_accepted_tokens < stats.num_proposed_tokens, "no proposal was rejected: rollback untested"
    assert sum(o.metrics.num_spec_proposed_tokens for o in outs) == stats.num_proposed_tokens
    assert sum(o.metrics.num_spec_accepted_tokens for o in outs) == stats.num_accepted_tokens
    assert all(o.metrics.num_spec_accepted_tokens <= o.metrics.num_spec_proposed_tokens for o in outs)
    assert stats.acceptance_rate == stats.num_accepted_tokens / stats.num_proposed_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert sum(stats.proposed_per_position) == stats.num_proposed_tokens


# ---- configuration ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa"}, "method must be one of"),
        ({"num_speculative_tokens": 3}, "needs a 'method'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer from 1"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min .4. is larger"),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min must be a positive integer"),
        ({"method": "draft"}, "model .the draft checkpoint. is required"),
        ({"method": "ngram", "model": "x"}, "ngram needs no model"),
        ({"method": "ngram", "lookahead": 3}, "unknown field.*lookahead"),
        ("ngram", "must be a dict or SpeculativeConfig"),
    ],
)
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", speculative_config=value)


def test_a_dict_becomes_a_typed_config():
    config = EngineConfig(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=2)


def test_a_draft_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    target = tiny_models("llama")
    bigger = Path(shutil.copytree(target, tmp_path / "bigger"))
    config = json.loads((bigger / "config.json").read_text())
    config["vocab_size"] += 64
    (bigger / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the target"):
        LLM(target, device="cpu", speculative_config={"method": "draft", "model": str(bigger)})
    swapped = Path(shutil.copytree(target, tmp_path / "swapped"))
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="different tokenizer"):
        LLM(target, device="cpu", speculative_config={"method": "draft", "model": str(swapped)})


# ---- prompt lookup ----------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert ngram_proposal([1, 2, 3, 4, 1, 2, 3], 3, 1, 3) == [4, 1, 2]
    # The 2-gram [1, 2] occurs twice: the latest occurrence wins.
    assert ngram_proposal([1, 2, 9, 1, 2, 7, 1, 2], 3, 2, 2) == [7, 1, 2]
    # The longest suffix that matches decides, before shorter ones: [3, 1, 2] -> 5, not [2] -> 8.
    assert ngram_proposal([2, 8, 3, 1, 2, 5, 6, 3, 1, 2], 2, 1, 3) == [5, 6]
    assert ngram_proposal([1, 2, 3, 4, 5], 3, 1, 3) == []  # no earlier occurrence
    assert ngram_proposal([7, 1, 2, 7, 3, 2], 3, 2, 3) == []  # only a 1-gram matches, below the minimum
    # A match near the end copies on into the copy: loops are proposed k tokens ahead.
    assert ngram_proposal([5, 5, 5], 4, 1, 2) == [5, 5, 5, 5]
    assert ngram_proposal([9, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]


# ---- greedy: exact ----------------------------------------------------------------------
def test_ngram_greedy_is_exact_with_chunked_prefill_and_prefix_caching(
    tiny_models, hf_reference, make_llm, monkeypatch
):
    path = tiny_models("llama", **LOOPING)
    hf = hf_reference(path)
    plain = make_llm(path, block_size=4).generate(PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    llm = make_llm(path, block_size=4, max_num_batched_tokens=24, speculative_config=NGRAM)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert_outputs_match(hf, PROMPTS, MAX_TOKENS, outs)
    _assert_speculated(llm, outs)
    assert all(sum(n for _, n, _ in s) <= 24 for s in steps), "the token budget must count the proposals"
    # A step verified proposals (a decode computing more than one token) beside a prefill chunk.
    assert any(any(n > 1 and c + 1 == t for c, n, t in s) and any(c + n < t for c, n, t in s) for s in steps), (
        "no step mixed a verification with a prefill chunk"
    )
    # Again, with the prompts' blocks in the prefix cache: hits must stay exact.
    again = llm.generate(PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in plain]
    assert all(o.num_cached_tokens > 0 for o, p in zip(again, PROMPTS, strict=True) if len(hf.encode(p)) > 4)
    # Prompts that continue those outputs hit the blocks written while proposals were being
    # verified and rejected: only verified tokens were hashed, so the hits are exact.
    followups = [o.prompt_token_ids + o.token_ids[:20] for o in plain]
    more = llm.generate(followups, greedy([10] * len(followups), ignore_eos=True))
    for ids, o in zip(followups, more, strict=True):
        assert o.num_cached_tokens >= (len(ids) - 1) // 4 * 4 - 4
        assert_greedy_match(o.token_ids, hf.greedy(ids, 10), label=str(ids))


def test_ngram_greedy_is_exact_under_preemption(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama", **LOOPING)
    llm = make_llm(path, block_size=4, num_kv_blocks=40, speculative_config=NGRAM)
    prompts = PROMPTS * 2
    outs = llm.generate(prompts, greedy(MAX_TOKENS * 2, ignore_eos=True))
    assert llm.engine.stats().num_preemptions > 0
    assert_outputs_match(hf_reference(path), prompts, MAX_TOKENS * 2, outs)
    _assert_speculated(llm, outs)


def test_ngram_greedy_is_exact_on_gpt_oss_with_chunked_prefill(tiny_models, hf_reference, make_llm):
    """Verification rows through the sinks, the sliding layers and the experts: a proposal's
    rows are scored like any prefill chunk's, so the tokens stay transformers' own."""
    path = tiny_models("gpt_oss", **LOOPING)
    llm = make_llm(path, block_size=4, max_num_batched_tokens=24, speculative_config=NGRAM)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)
    _assert_speculated(llm, outs)


def test_draft_target_as_its_own_draft_accepts_nearly_everything(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    spec = {"method": "draft", "model": path, "num_speculative_tokens": 3}
    llm = make_llm(path, block_size=4, max_num_batched_tokens=32, speculative_config=spec)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)
    _assert_speculated(llm, outs, rejections=False)
    stats = _spec(llm.engine.stats())
    assert stats.acceptance_rate > 0.95
    assert len(stats.acceptance_rate_per_position) == 3


def test_a_smaller_draft_keeps_greedy_exact_under_preemption_and_chunking(
    tiny_models, hf_reference, make_llm, tmp_path
):
    path = tiny_models("llama", **LOOPING)
    draft = build_truncated_draft(path, tmp_path / "draft", num_layers=1)  # the target's first layer alone
    spec = {"method": "draft", "model": str(draft), "num_speculative_tokens": 3}
    llm = make_llm(path, block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, speculative_config=spec)
    prompts = PROMPTS * 2
    outs = llm.generate(prompts, greedy(MAX_TOKENS * 2, ignore_eos=True))
    assert llm.engine.stats().num_preemptions > 0
    assert_outputs_match(hf_reference(path), prompts, MAX_TOKENS * 2, outs)
    _assert_speculated(llm, outs)


def _record_draft_chunks(monkeypatch, llm: LLM) -> list[list[int]]:
    """The lengths of the chunks the draft model computes, one list per draft forward pass."""
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.draft is not None
    draft = speculator.draft
    forward = draft._forward
    seen: list[list[int]] = []

    def recording(chunks, tables, want):
        seen.append([len(tokens) for _, tokens in chunks])
        return forward(chunks, tables, want)

    monkeypatch.setattr(draft, "_forward", recording)
    return seen


def test_the_draft_computes_prompts_in_the_targets_chunks_and_reuses_cached_prefixes(
    tiny_models, hf_reference, make_llm, monkeypatch
):
    """The draft keeps step with the target: a long prompt reaches it chunk by chunk within
    the step's token budget (never as one catch-up over the whole prompt when the request
    starts to speculate), and a prompt whose prefix is cached starts after the cached tokens,
    reading the draft K/V that the first request left in the shared blocks. With the target
    as its own draft, every proposal is accepted only if that K/V is right."""
    path = tiny_models("llama")
    spec = {"method": "draft", "model": path, "num_speculative_tokens": 3}
    llm = make_llm(path, block_size=4, max_num_batched_tokens=16, speculative_config=spec)
    chunks = _record_draft_chunks(monkeypatch, llm)
    hf = hf_reference(path)
    long_prompt = " ".join(PROMPTS)
    n_prompt = len(hf.encode(long_prompt))
    assert n_prompt > 40
    first = llm.generate([long_prompt], greedy([12], ignore_eos=True))[0]
    assert_greedy_match(first.token_ids, hf.greedy(hf.encode(long_prompt), 12), "first")
    assert max(max(c) for c in chunks) <= 16, f"the draft caught up over more than a step's budget: {chunks}"
    assert sum(sum(c) for c in chunks) <= n_prompt + 12 + 3 * 12, "the draft computed tokens more than once"
    chunks.clear()
    follow = first.prompt_token_ids + first.token_ids[:8]
    second = llm.generate([follow], greedy([12], ignore_eos=True))[0]
    assert_greedy_match(second.token_ids, hf.greedy(follow, 12), "follow-up")
    assert second.num_cached_tokens >= len(follow) - 8
    fed = sum(sum(c) for c in chunks)
    assert fed <= len(follow) - second.num_cached_tokens + 12 * 4, (fed, second.num_cached_tokens)
    stats = _spec(llm.engine.stats())
    assert stats.num_accepted_tokens == stats.num_proposed_tokens > 0


def test_a_sliding_window_draft_lets_blocks_be_released_and_never_reads_them(
    tiny_models, hf_reference, make_llm, tmp_path
):
    """Mistral (every layer slides, window 8) with its own first layer as the draft: blocks
    out of the window are released while both models run, and every freed block's K/V, the
    target's and the draft's, is overwritten with huge values. The tokens stay transformers';
    the draft, which never reads a released block, keeps proposing what the target accepts
    (the target as its own draft: all of it). A draft that sees further than the target (no
    window) keeps every block."""
    path = tiny_models("mistral", sliding_window=8)
    max_tokens = [m + 20 for m in MAX_TOKENS]
    kwargs = dict(block_size=4, num_kv_blocks=80, max_num_seqs=10, enable_prefix_caching=False)
    spec = {"method": "draft", "model": path, "num_speculative_tokens": 3}
    llm = make_llm(path, speculative_config=spec, **kwargs)
    assert llm.engine.release_window == 8
    pool, caches = llm.engine.kv.pool, [llm.engine.runner.kv_cache, *llm.engine.speculator.draft.kv_caches]
    free = pool.free
    released: list[int] = []

    def free_and_poison(blocks):
        free(blocks)
        for block in blocks:
            if block.ref_cnt == 0:
                released.append(block.block_id)
                caches[0][:, :, block.block_id] = 1e3
                for k, v in caches[1:]:
                    k[block.block_id] = 1e3
                    v[block.block_id] = 1e3

    pool.free = free_and_poison
    outs = llm.generate(PROMPTS, greedy(max_tokens, ignore_eos=True))
    assert_outputs_match(hf_reference(path), PROMPTS, max_tokens, outs)
    stats = _spec(llm.engine.stats())
    assert len(released) > len(PROMPTS), "no block was released while the requests ran"
    assert stats.num_accepted_tokens == stats.num_proposed_tokens > 0
    full_attention_draft = tiny_models("llama")  # same tiny vocabulary, attends to everything
    assert (
        make_llm(path, speculative_config={**spec, "model": full_attention_draft}, **kwargs).engine.release_window
        is None
    )


def test_stops_penalties_and_logprobs_match_plain_decoding(tiny_models, make_llm):
    path = tiny_models("llama", **LOOPING)
    plain_llm = make_llm(path, block_size=4)
    base = plain_llm.generate(PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    # A stop id and a stop string from the middle of each plain output: never emitted past.
    params = []
    for o, m in zip(base, MAX_TOKENS, strict=True):
        stop_id = o.token_ids[m // 2]
        params.append(SamplingParams(max_tokens=m, temperature=0, stop_token_ids=[stop_id], logprobs=2))
        params.append(SamplingParams(max_tokens=m, temperature=0, stop=[o.text[len(o.text) // 3 :][:4]]))
        params.append(SamplingParams(max_tokens=m, temperature=0, repetition_penalty=1.3, frequency_penalty=0.2))
        params.append(SamplingParams(max_tokens=m, temperature=0, min_tokens=m - 2, stream=True))
    prompts = [p for p in PROMPTS for _ in range(4)]
    expected = plain_llm.generate(prompts, params)
    llm = make_llm(path, block_size=4, speculative_config=NGRAM)
    outs = llm.generate(prompts, params)
    for e, o in zip(expected, outs, strict=True):
        assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == (
            e.token_ids,
            e.text,
            e.finish_reason,
            e.stop_reason,
        )
        if e.logprobs is not None:
            assert o.logprobs is not None and len(o.logprobs) == len(e.logprobs)
            for a, b in zip(o.logprobs, e.logprobs, strict=True):
                assert a.keys() == b.keys()
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    _assert_speculated(llm, outs)


def test_streamed_deltas_add_up(tiny_models):
    path = tiny_models("llama", **LOOPING)
    llm = LLM(path, device="cpu", dtype="float32", speculative_config=NGRAM)
    engine = llm.engine
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stream=True))
    got: list[int] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.extend(out.new_token_ids)
            final = out
    assert final is not None and final.finished and got == final.token_ids and len(got) == 30
    assert _spec(engine.stats()).num_accepted_tokens > 0


# ---- sampling: the distribution is unchanged ---------------------------------------------
CHI2_Z = 3.719  # the standard normal quantile of 1 - 1e-4


def _chi2_critical(df: int, z: float = CHI2_Z) -> float:
    """Wilson-Hilferty: the chi-square quantile with ``df`` degrees of freedom at ``z``."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _second_token_chi2(llm: LLM, hf, prompt_ids: list[int], draws: int) -> tuple[float, int]:
    """The second token's distribution given the first, against transformers' probabilities:
    a chi-square statistic summed over the most frequent first tokens, and its degrees of freedom."""
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(draws)]
    outs = llm.generate([prompt_ids] * draws, params)
    by_first: dict[int, Counter] = {}
    for o in outs:
        by_first.setdefault(o.token_ids[0], Counter())[o.token_ids[1]] += 1
    stat, df = 0.0, 0
    for first, counts in by_first.items():
        n = sum(counts.values())
        if n < 100:
            continue
        with torch.no_grad():
            logits = hf.model(torch.tensor([[*prompt_ids, first]])).logits[0, -1].float()
        p = logits.softmax(-1)
        common = [t for t in range(len(p)) if n * p[t] >= 5]
        expected = [n * float(p[t]) for t in common] + [n * (1 - float(p[common].sum()))]
        observed = [counts[t] for t in common] + [n - sum(counts[t] for t in common)]
        stat += sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
        df += len(common)
    assert df >= 5, "too few draws per first token for the test to have power"
    return stat, df


def test_sampling_with_speculation_keeps_the_distribution(tiny_models, hf_reference, monkeypatch):
    path = tiny_models("llama")
    hf = hf_reference(path)
    # The target as its own greedy draft proposes the target's most likely token: accepted
    # often (its probability), rejected otherwise, so both branches of the rule are drawn.
    spec = {"method": "draft", "model": path, "num_speculative_tokens": 2}
    llm = LLM(path, device="cpu", dtype="float32", speculative_config=spec)
    prompt = [5, 17, 33, 80, 121, 7]
    stat, df = _second_token_chi2(llm, hf, prompt, 800)
    stats = _spec(llm.engine.stats())
    assert 0 < stats.num_accepted_tokens < stats.num_proposed_tokens
    assert stat < _chi2_critical(df), f"chi-square {stat:.1f} with {df} degrees of freedom"

    # The same test catches a wrong acceptance rule: accepting every proposal.
    monkeypatch.setattr(verifier, "accepts", lambda p, u: True)
    wrong = LLM(path, device="cpu", dtype="float32", speculative_config=spec)
    stat, df = _second_token_chi2(wrong, hf, prompt, 800)
    assert stat > _chi2_critical(df), f"always accepting went unnoticed (chi-square {stat:.1f}, df {df})"


def test_seeded_sampling_with_speculation_is_reproducible(tiny_models):
    path = tiny_models("llama", **LOOPING)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in range(6)]
    runs = []
    for _ in range(2):
        llm = LLM(path, device="cpu", dtype="float32", speculative_config=NGRAM)
        runs.append([o.token_ids for o in llm.generate(PROMPTS[:3] * 2, params)])
    assert runs[0] == runs[1]


# ---- the KV cache -------------------------------------------------------------------------
def test_proposed_tokens_are_never_hashed_and_rollback_frees_empty_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(), max_total_tokens=64, eos_token_ids=frozenset(), arrival_seq=0)
    assert kv.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    req.append_token(6)
    # A decode of token 6 with 6 proposals: positions 5..11 fill blocks 1 and 2, but only
    # the verified tokens (up to 6) may be hashed: block 1 is not full of them yet.
    assert kv.allocate_slots(req, 1 + 6)
    assert len(kv.block_ids("r")) == 3 and kv.num_cached_blocks == 1
    # All proposals rejected: the request holds 6 computed tokens, block 2 is empty again.
    req.num_computed_tokens = 6
    kv.trim(req, req.num_computed_tokens)
    assert len(kv.block_ids("r")) == 2 and kv.num_free_blocks == 6
    kv.free(req)
    assert kv.num_free_blocks == 8


def test_short_of_blocks_a_decode_speculates_less_rather_than_preempt():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [
        Request(f"r{i}", [1, 2, 3], SamplingParams(), max_total_tokens=64, eos_token_ids=frozenset(), arrival_seq=i)
        for i in range(2)
    ]
    for req in reqs:
        scheduler.add_request(req)
    assert scheduler.schedule().num_new_tokens == [3, 3]
    for req in reqs:
        req.num_computed_tokens = 3
        req.append_token(4)
    reqs[0].num_lookahead_tokens = 8  # 9 tokens would need two more blocks; one is free
    out = scheduler.schedule()
    assert out.num_preempted == 0 and out.requests == reqs
    assert out.num_spec_tokens == {"r0": 4} and out.num_new_tokens == [5, 1]
    assert kv.num_free_blocks == 0


def test_requests_with_structured_outputs_are_not_speculated(tiny_models, make_llm):
    path = tiny_models("llama", **LOOPING)
    llm = make_llm(path, speculative_config=NGRAM)
    choice = SamplingParams(max_tokens=20, temperature=0, structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outs = llm.generate([PROMPTS[1], PROMPTS[1]], [choice, free])
    assert outs[0].text in ("yes", "no") and outs[0].metrics.num_spec_proposed_tokens == 0
    assert outs[1].metrics.num_spec_accepted_tokens > 0
