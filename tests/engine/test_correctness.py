"""Greedy outputs token for token against transformers (float32, CPU, batch of one, no padding)."""

from __future__ import annotations

import pytest

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.helpers import (
    assert_chunked_prefill_steps,
    assert_no_leaks,
    model_case,
    record_steps,
)
from tests.engine.reference import assert_greedy_match, assert_outputs_match, greedy

PROMPTS = [
    "The chef will bring",
    "Seven guests wait at the table and the waiter pours cold water while the kitchen",
    "Tea",
    "queue worker engine cache block page prompt model output shard job one two three four five six",
    "Warm bread and fresh fish",
    "A",
    "Count to ten: one two three four five six seven eight nine ten, then eleven twelve and more",
    "Late guests ask the waiter about the menu, the bill, the tip and the sweet cake.",
    "Serve",
    "Seven hundred tokens in a batch queue",
]
MAX_TOKENS = [24, 7, 40, 12, 33, 50, 1, 18, 29, 15]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# YaRN as Qwen and DeepSeek set it (the ramp's ends rounded: ``truncate`` left at its default);
# gpt-oss's own (``truncate: false``) is in its tiny checkpoint.
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


# gpt_neox, granite and cohere have no native forward pass: they run through the transformers fallback.
@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "phi3",
        "phi3-longrope",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "qwen2_moe-dense-layers",
        "gemma2",
        "gemma3",
        "gemma3-tied",
        "glm4_moe",
        "gemma4",
        "gemma4-moe",
        "mistral-window",
        "gpt_oss",
        "smollm3",
        "olmo3",
        "deepseek_v3",
        "deepseek_v3-yarn",
        "gpt_neox",
        "granite",
        "cohere",
    ],
)
def test_batch_of_mixed_prompts_matches_transformers(family, tiny_models, hf_reference, make_llm):
    path, kwargs = model_case(tiny_models, family)
    llm = make_llm(path, **kwargs)
    params = greedy(MAX_TOKENS)
    outs = llm.generate(PROMPTS, params)
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)
    # EOS ends a request early only where transformers' generate ends too.
    assert {o.finish_reason for o in outs} <= {"length", "stop"}


@pytest.mark.parametrize(
    "family",
    [
        *("llama", "qwen3", "phi3-longrope", "mixtral", "qwen3_moe", "gemma2", "gemma3", "glm4_moe"),
        *("gemma4", "gemma4-moe", "gpt_oss", "smollm3", "olmo3", "deepseek_v3", "gpt_neox", "granite"),
    ],
)
def test_requests_joining_mid_flight(family, tiny_models, hf_reference):
    path, kwargs = model_case(tiny_models, family)
    hf = hf_reference(path)
    engine = LLMEngine(EngineConfig(path, dtype="float32", device="cpu", max_num_seqs=4, **kwargs))
    finished = {}
    schedule = {0: [0, 1, 2], 3: [3, 4], 5: [5, 6, 7], 11: [8, 9]}  # step -> prompts added
    step = 0
    while step <= max(schedule) or engine.has_unfinished_requests():
        for i in schedule.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
    assert_outputs_match(hf, PROMPTS, MAX_TOKENS, [finished[f"r{i}"] for i in range(len(PROMPTS))])
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "family",
    [
        *("llama", "qwen2", "phi3-longrope", "qwen2_moe", "gemma2", "gemma3", "glm4_moe", "gemma4"),
        *("gemma4-moe", "mistral-window", "gpt_oss", "smollm3", "olmo3", "deepseek_v3", "gpt_neox"),
        *("granite",),
    ],
)
def test_preemption_when_kv_cache_is_small(family, tiny_models, hf_reference, make_llm):
    path, kwargs = model_case(tiny_models, family)
    # 10 blocks of 8 tokens: far less than the batch needs at once, more than any one request.
    llm = make_llm(path, block_size=8, num_kv_blocks=10, **kwargs)
    params = greedy([m + 20 for m in MAX_TOKENS])
    outs = llm.generate(PROMPTS, params)
    assert_outputs_match(hf_reference(path), PROMPTS, [m + 20 for m in MAX_TOKENS], outs)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats.num_preemptions


@pytest.mark.parametrize(
    "family",
    [
        "qwen3",
        "mistral",
        "phi3-longrope",
        "mixtral",
        "qwen2_moe",
        "gemma2",
        "gemma3",
        "glm4_moe",
        "gemma4",
        "gemma4-moe",
        "mistral-window",
        "gpt_oss",
        "smollm3",
        "olmo3",
        "deepseek_v3",
        "gpt_neox",
        "granite",
    ],
)
def test_chunked_prefill_under_a_small_token_budget(family, tiny_models, hf_reference, make_llm, monkeypatch):
    path, kwargs = model_case(tiny_models, family)
    llm = make_llm(path, max_num_batched_tokens=8, max_num_seqs=8, **kwargs)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    params = greedy(MAX_TOKENS)
    outs = llm.generate(PROMPTS, params)
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)
    assert_chunked_prefill_steps(steps, budget=8)
    partial = [s for s in steps if any(c + n < t for c, n, t in s)]
    assert partial, "no prompt was prefilled in chunks"


def test_prefix_caching_off_gives_the_same_tokens(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    llm = make_llm(path, enable_prefix_caching=False, block_size=4)
    params = greedy(MAX_TOKENS)
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, llm.generate(PROMPTS, params))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"legacy_config": True},
        {"rope_scaling": LLAMA3_ROPE},
        {"rope_scaling": LLAMA3_ROPE, "legacy_config": True},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"tie_word_embeddings": True, "num_kv_heads": 4},
        {"num_kv_heads": 1, "head_dim": 32},
        {"rope_scaling": YARN_ROPE},
    ],
    ids=["4x-config", "llama3-rope", "llama3-rope-4x-config", "linear-rope", "tied-mha", "mqa-headdim32", "yarn-rope"],
)
def test_config_variants_match_transformers(kwargs, tiny_models, hf_reference, make_llm):
    path = tiny_models("llama", **kwargs)
    llm = make_llm(path)
    prompts, max_tokens = PROMPTS[:4], [30, 30, 30, 30]
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0))
    assert_outputs_match(hf_reference(path), prompts, max_tokens, outs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"partial_rotary_factor": 1.0},
        {"partial_rotary_factor": 0.5},
        {"partial_rotary_factor": 0.5, "legacy_config": True},
    ],
    ids=["full-rotary", "partial-rotary", "partial-rotary-4x-config"],
)
def test_phi3_long_factors_past_the_original_context_match_transformers(kwargs, tiny_models, hf_reference, make_llm):
    """An original context of 8 tokens and prompts longer than it: transformers turns every
    token with the long factors (and the attention factor of 2048 / 8), as our engine does
    when its max_model_len passes the original context."""
    half = int(16 * kwargs["partial_rotary_factor"]) // 2
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.3 * i for i in range(half)],
        "long_factor": [2.0 + 1.5 * i for i in range(half)],
        "original_max_position_embeddings": 8,
    }
    path = tiny_models("phi3", rope_scaling=rope, **kwargs)
    hf = hf_reference(path)
    prompts = [p for p in PROMPTS if len(hf.encode(p)) > 8]
    assert len(prompts) >= 4
    llm = make_llm(path)
    assert llm.engine.max_model_len > 8
    outs = llm.generate(prompts, greedy([30] * len(prompts)))
    assert_outputs_match(hf, prompts, [30] * len(prompts), outs)


def test_chat_messages_use_the_chat_template(tiny_models, hf_reference, make_llm):
    path = tiny_models("qwen3")
    hf = hf_reference(path)
    llm = make_llm(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bring the soup"}]
    out = llm.generate([{"messages": messages}], SamplingParams(max_tokens=20, temperature=0))[0]
    text = hf.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf.tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert_greedy_match(out.token_ids, hf.greedy(ids, 20), "chat")


def test_blocks_out_of_the_window_are_released(tiny_models, hf_reference, make_llm, monkeypatch):
    """Mistral with an 8-token window over blocks of 4: a request keeps only the blocks its
    window still reaches, so a cache that makes the full-context engine preempt serves the
    whole batch at once, with transformers' tokens."""
    path = tiny_models("mistral", sliding_window=8)
    max_tokens = [m + 20 for m in MAX_TOKENS]
    kwargs = dict(block_size=4, num_kv_blocks=56, max_num_seqs=10)
    llm = make_llm(path, **kwargs)
    assert llm.engine.release_window == 8
    outs = llm.generate(PROMPTS, greedy(max_tokens))
    assert_outputs_match(hf_reference(path), PROMPTS, max_tokens, outs)
    assert llm.engine.stats().num_preemptions == 0
    # The same cache without releasing: the batch no longer fits (and still matches).
    keep_all = make_llm(path, **kwargs)
    keep_all.engine.release_window = None
    outs = keep_all.generate(PROMPTS, greedy(max_tokens))
    assert_outputs_match(hf_reference(path), PROMPTS, max_tokens, outs)
    assert keep_all.engine.stats().num_preemptions > 0


def test_released_windows_survive_rejected_proposals(tiny_models, hf_reference, make_llm):
    """Blocks are released while proposals are verified: a rejection rolls the request back,
    and the blocks its window then reaches must still be its own. Every freed block's K/V is
    overwritten with huge values (no prefix caching: nothing may read a freed block; finite, as
    masked-out keys of the table are still multiplied by a zero weight), so reading one that
    was released too early shows in the tokens."""
    path = tiny_models("mistral", sliding_window=8)
    max_tokens = [m + 20 for m in MAX_TOKENS]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = make_llm(
        path, block_size=4, num_kv_blocks=56, max_num_seqs=10, speculative_config=spec, enable_prefix_caching=False
    )
    assert llm.engine.release_window == 8
    pool, kv_cache = llm.engine.kv.pool, llm.engine.runner.kv_cache
    free = pool.free

    def free_and_poison(blocks):
        free(blocks)
        for block in blocks:
            if block.ref_cnt == 0:
                kv_cache[:, :, block.block_id] = 1e3

    pool.free = free_and_poison
    outs = llm.generate(PROMPTS, greedy(max_tokens))
    assert_outputs_match(hf_reference(path), PROMPTS, max_tokens, outs)
    stats = llm.engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens < stats.num_proposed_tokens  # rollbacks happened


def test_no_blocks_are_released_when_some_layers_attend_to_everything(tiny_models, make_llm):
    assert make_llm(tiny_models("gemma2")).engine.release_window is None
    assert make_llm(tiny_models("mistral")).engine.release_window is None
