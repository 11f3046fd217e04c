"""Qwen3.5 and Qwen3.5-MoE (hybrid: gated DeltaNet linear attention and gated full attention)
against transformers, greedy and token for token in float32, in the engine's conditions: a
batch of mixed lengths, requests joining mid-flight, preemption under a tight KV cache, chunked
prefill under a small token budget (the state carried across chunks, chunks mixed with
decodes), follow-ups sharing a prefix (prefix caching is off for hybrid models), and ngram
speculative decoding (rejections roll the state back to a snapshot). Every
engine built here ends with no KV block and no state slot held (``assert_no_leaks``)."""

from __future__ import annotations

import pytest

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.engine.memory.state_memory import HybridMemory
from conveyor.engine.models.model_config import ModelSpec
from conveyor.testing.tiny_models import build_tiny_multimodal_qwen3_5
from tests.engine.helpers import assert_chunked_prefill_steps, assert_no_leaks, model_case, record_steps, spy
from tests.engine.reference import assert_outputs_match, greedy

HYBRID = ["qwen3_5", "qwen3_5_moe"]
PROMPTS = [
    "The chef will bring",
    "Seven guests wait at the table and the waiter pours cold water while the kitchen",
    "Tea",
    "queue worker engine cache block page prompt model output shard job one two three four five six",
    "Warm bread and fresh fish",
    "A",
    "Count to ten: one two three four five six seven eight nine ten, then eleven twelve and more",
    "Late guests ask the waiter about the menu, the bill, the tip and the sweet cake.",
]
MAX_TOKENS = [24, 7, 40, 12, 33, 50, 1, 18]


@pytest.mark.parametrize("family", HYBRID)
def test_batch_of_mixed_prompts_matches_transformers(family, tiny_models, hf_reference, make_llm):
    path, kwargs = model_case(tiny_models, family)
    llm = make_llm(path, **kwargs)
    assert isinstance(llm.engine.kv, HybridMemory)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)


@pytest.mark.parametrize("family", HYBRID)
def test_requests_joining_mid_flight(family, tiny_models, hf_reference):
    path, kwargs = model_case(tiny_models, family)
    engine = LLMEngine(EngineConfig(path, dtype="float32", device="cpu", max_num_seqs=3, **kwargs))
    finished = {}
    schedule = {0: [0, 1, 2], 3: [3, 4], 5: [5, 6], 9: [7]}  # step -> prompts added
    step = 0
    while step <= max(schedule) or engine.has_unfinished_requests():
        for i in schedule.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
    outs = [finished[f"r{i}"] for i in range(len(PROMPTS))]
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)
    assert_no_leaks(engine)


@pytest.mark.parametrize("family", HYBRID)
def test_preemption_when_kv_cache_is_small(family, tiny_models, hf_reference, make_llm):
    path, kwargs = model_case(tiny_models, family)
    # 10 blocks of 8 tokens: far less than the batch needs at once, more than any one request.
    llm = make_llm(path, block_size=8, num_kv_blocks=10, **kwargs)
    max_tokens = [m + 20 for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, greedy(max_tokens))
    assert_outputs_match(hf_reference(path), PROMPTS, max_tokens, outs)
    assert llm.engine.stats().num_preemptions > 0  # each recomputed its state from zero


# Qwen3-Next (the same layers, its linear projections fused per key head, a dense MLP layer
# among the sparse ones) in this one: mixed lengths, prefill chunks mixed with decodes.
@pytest.mark.parametrize("family", [*HYBRID, "qwen3_next"])
def test_chunked_prefill_carries_the_state_across_chunks(family, tiny_models, hf_reference, make_llm, monkeypatch):
    path, kwargs = model_case(tiny_models, family)
    llm = make_llm(path, max_num_batched_tokens=8, max_num_seqs=8, **kwargs)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)
    assert_chunked_prefill_steps(steps, budget=8)
    assert [s for s in steps if any(c + n < t for c, n, t in s)], "no prompt was prefilled in chunks"


@pytest.mark.parametrize("family", HYBRID)
def test_follow_ups_sharing_a_prefix_recompute_it(family, tiny_models, hf_reference, make_llm):
    path, kwargs = model_case(tiny_models, family)
    llm = make_llm(path, block_size=4, enable_prefix_caching=True, **kwargs)
    system = "Seven guests wait at the table and the waiter pours cold water while the kitchen"
    first = [system + " serves soup.", system + " bakes bread."]
    second = [system + " pours wine.", system + " serves soup. Then tea"]
    hf = hf_reference(path)
    for prompts in (first, second):
        outs = llm.generate(prompts, greedy([16] * len(prompts)))
        assert_outputs_match(hf, prompts, [16] * len(prompts), outs)
        # Prefix caching is off for hybrid models: nothing is reused, everything recomputed.
        assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
    assert not llm.engine.kv.enable_caching


def test_one_token_prompts_and_decodes_start_from_a_zero_state(tiny_models, hf_reference, make_llm):
    # A one-token prompt's first step is a "decode" row: its slot must start from zero even
    # though the slot held a finished request's state before.
    path, kwargs = model_case(tiny_models, "qwen3_5")
    llm = make_llm(path, max_num_seqs=2, **kwargs)
    hf = hf_reference(path)
    for prompts in (["Warm bread and fresh fish", "Tea"], ["A", "B"]):
        assert_outputs_match(hf, prompts, [9, 9], llm.generate(prompts, greedy([9, 9])))


def test_a_multimodal_checkpoint_runs_its_language_model(tiny_models, hf_reference, make_llm, tmp_path):
    path, kwargs = model_case(tiny_models, "qwen3_5")
    wrapper = str(build_tiny_multimodal_qwen3_5(tmp_path / "qwen3_5-vl", path))
    llm = make_llm(wrapper, **kwargs)  # model_impl auto: native, the vision tower's tensors skipped
    assert llm.engine.model_impl == "native"
    prompts = PROMPTS[:3]
    # transformers' Qwen3_5ForConditionalGeneration on the text alone, as the oracle
    assert_outputs_match(hf_reference(wrapper), prompts, MAX_TOKENS[:3], llm.generate(prompts, greedy(MAX_TOKENS[:3])))


def test_the_transformers_fallback_refuses_linear_attention(tiny_models):
    path, kwargs = model_case(tiny_models, "qwen3_5")
    config = EngineConfig(path, dtype="float32", device="cpu", model_impl="transformers", **kwargs)
    with pytest.raises(ValueError, match=r"linear-attention \(hybrid\) layers are not supported by the transformers"):
        LLMEngine(config)


# Repetitive prompts and small weights (a tiny random model then falls into loops, with breaks
# between them): prompt lookup proposes, proposals are accepted and rejected, and a rejection
# before the request ends rolls its state back to a snapshot.
SPEC_PROMPTS = [
    "Seven eight nine ten, seven eight nine ten, seven eight",
    "A guest asks for the menu and the bill; the waiter brings the menu, then the bill, then",
    "Tea",
    "one two three one two three one two three one two",
    "The chef will bring the soup to the table",
]
SPEC_MAX_TOKENS = [30, 40, 20, 36, 30]


@pytest.mark.parametrize("family", HYBRID)
def test_ngram_speculative_decoding_matches_transformers(family, tiny_models, hf_reference, make_llm, monkeypatch):
    path = tiny_models(family, num_layers=4, init_std=0.005)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_llm(path, speculative_config=ngram)
    state = llm.engine.kv.state
    assert state is not None and state.num_snapshots == 3
    rollbacks = spy(monkeypatch, state, "rollback")
    outs = llm.generate(SPEC_PROMPTS, greedy(SPEC_MAX_TOKENS, ignore_eos=True))
    assert_outputs_match(hf_reference(path), SPEC_PROMPTS, SPEC_MAX_TOKENS, outs)
    stats = llm.engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0, "no proposal was accepted"
    assert stats.num_accepted_tokens < stats.num_proposed_tokens, "no proposal was rejected"
    assert rollbacks, "no request went on after a rejection: no state was rolled back"


def test_a_hybrid_draft_model_is_refused(tiny_models):
    path, kwargs = model_case(tiny_models, "qwen3_5")
    draft = {"method": "draft", "model": path, "num_speculative_tokens": 2}
    config = EngineConfig(path, dtype="float32", device="cpu", speculative_config=draft, **kwargs)
    with pytest.raises(ValueError, match="is a hybrid \\(linear-attention\\) model: a draft's recurrent state"):
        LLMEngine(config)


def test_speculative_decoding_under_tensor_parallelism_is_refused(tiny_models):
    path, kwargs = model_case(tiny_models, "qwen3_5")
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    config = EngineConfig(
        path, dtype="float32", device="cpu", tensor_parallel_size=2, speculative_config=ngram, **kwargs
    )
    with pytest.raises(ValueError, match="not served under tensor parallelism: a rejected proposal's state rollback"):
        LLMEngine(config)


def test_spec_of_qwen3_5_9b_config():
    # Qwen3.5-9B's published text config (its numbers; layer_types from full_attention_interval).
    cfg = {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "full_attention_interval": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
    }
    spec = ModelSpec.from_dicts(cfg)
    lin = spec.linear_attention
    assert lin is not None and spec.rotary_dim == 64
    assert lin.linear_layers == tuple((i + 1) % 4 != 0 for i in range(32))
    assert lin.conv_dim == 8192
    # 24 linear layers x (conv 8192 x 3 bf16 + recurrent 32 x 128 x 128 float32)
    assert lin.state_bytes(2) == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)


def test_bad_hybrid_config_is_refused():
    cfg = {
        "model_type": "qwen3_5_text",
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "layer_types": ["linear_attention", "sliding_attention"],
    }
    with pytest.raises(ValueError, match="layer_types"):
        ModelSpec.from_dicts(cfg)
