"""DeepSeek-V3's own parts beyond the shared engine conditions (those are in test_correctness,
test_prefix_caching, test_triton_backend and test_bf16_logits): the latent cache's layout and
size, YaRN against transformers' own function, grouped routing against transformers' router,
tensor parallelism over the heads, the checkpoint's extra layer skipped, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from conveyor.engine.models.kv_layout import KVLayout
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.models.moe import grouped_sigmoid_route
from conveyor.engine.models.yarn import yarn_inv_freq
from tests.engine.helpers import assert_no_leaks
from tests.engine.reference import assert_outputs_match, greedy

PROMPTS = [
    "The chef brings warm bread to the guest at the table by the window",
    "One two three",
    "Queue worker engine cache block page prompt model output shard job batch token",
]
MAX_TOKENS = [16, 24, 8]


def test_the_cache_holds_one_latent_and_rope_key_per_token(tiny_models, make_llm):
    path = tiny_models("deepseek_v3")
    llm = make_llm(path, block_size=4, num_kv_blocks=20)
    runner = llm.engine.runner
    # 2 layers x 1 part x 20 blocks x 4 tokens x 1 "head" x (kv_lora_rank 32 + rope 8)
    assert runner.kv_cache.shape == (2, 1, 20, 4, 1, 40)
    assert runner.kv_layout.block_bytes(4, torch.float32) == 2 * 4 * 40 * 4
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert [len(o.token_ids) for o in outs] == MAX_TOKENS
    assert_no_leaks(llm.engine)


def test_latent_bytes_per_token_at_deepseek_v3_shapes():
    """DeepSeek-V3 (671B): 61 layers of a 512 latent plus a 64 rope key, against the per-head
    K/V of 128 heads of 192 (keys) and 128 (values) it would otherwise cache."""
    cfg = DeepseekV3Config().to_dict()  # transformers' defaults are DeepSeek-V3's shapes
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    spec = ModelSpec.from_dicts(cfg)
    assert spec.mla is not None and spec.num_layers == 61
    latent = KVLayout.for_model(spec, 1).block_bytes(1, torch.bfloat16)
    assert latent == 61 * 576 * 2 == 70_272
    per_head = 61 * spec.num_heads * (192 + 128) * 2
    assert per_head / latent > 71


@pytest.mark.parametrize(
    "params",
    [
        # DeepSeek-V3's own
        {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0},
        # an attention factor apart from 1, the correction range not truncated (gpt-oss writes that)
        {
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
            "mscale": 0.7,
            "mscale_all_dim": 1.0,
            "truncate": False,
        },
    ],
)
def test_yarn_matches_transformers(params):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    config = DeepseekV3Config(rope_parameters=rope, max_position_embeddings=163840)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    got, factor = yarn_inv_freq(64, 10000.0, rope, 163840)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert factor == pytest.approx(want_factor)


def test_grouped_routing_matches_transformers_router():
    config = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 32)
    spec = ModelSpec.from_dicts(
        {**config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2}
    )
    assert spec.moe is not None
    logits, want_w, want_ids = router(x)
    got_w, got_ids = grouped_sigmoid_route(logits, router.e_score_correction_bias, spec.moe)
    order_w, order_g = want_ids.sort(dim=-1), got_ids.sort(dim=-1)
    assert torch.equal(order_w.values, order_g.values)
    torch.testing.assert_close(got_w.gather(1, order_g.indices), want_w.gather(1, order_w.indices))


def test_two_ranks_split_the_heads_and_experts(tiny_models, hf_reference, make_llm):
    path = tiny_models("deepseek_v3")
    kwargs = {"max_num_batched_tokens": 16, "block_size": 4}
    single = make_llm(path, **kwargs).generate(PROMPTS, greedy(MAX_TOKENS))
    llm = make_llm(path, tensor_parallel_size=2, **kwargs)
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
        again = llm.generate(PROMPTS, greedy(MAX_TOKENS))  # every rank's latents, from the prefix cache
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    assert [o.token_ids for o in again] == [o.token_ids for o in single]
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)


def test_the_multi_token_prediction_layer_is_skipped(tiny_models, hf_reference, make_llm, tmp_path):
    """Released checkpoints carry one more layer than ``num_hidden_layers`` (multi-token
    prediction); transformers ignores it and so does the loader."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m"
    shutil.copytree(tiny_models("deepseek_v3"), path)
    weights = load_file(path / "model.safetensors")
    weights["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, path / "model.safetensors")
    outs = make_llm(str(path)).generate(PROMPTS[:1], greedy(MAX_TOKENS[:1]))
    assert_outputs_match(hf_reference(tiny_models("deepseek_v3")), PROMPTS[:1], MAX_TOKENS[:1], outs)


def test_attention_bias_is_refused(tiny_models):
    cfg = json.loads((Path(tiny_models("deepseek_v3")) / "config.json").read_text())
    with pytest.raises(ValueError, match="deepseek_v3 with attention_bias is not supported"):
        ModelSpec.from_dicts({**cfg, "attention_bias": True})


def test_ngram_speculation_verifies_through_the_latent_cache(tiny_models, hf_reference, make_llm):
    """Proposals verified as multi-token rows over the latent cache (decompressed), rejected
    ones rolled back: the tokens stay transformers'. (A small init makes the model repeat
    itself, so that prompt lookup finds proposals and some are accepted.)"""
    path = tiny_models("deepseek_v3", init_std=0.02)
    prompts = ["Seven eight nine ten, seven eight nine ten, seven eight", "The chef will bring the soup to the table"]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_llm(path, block_size=4, speculative_config=ngram)
    outs = llm.generate(prompts, greedy([24, 24], ignore_eos=True))
    assert_outputs_match(hf_reference(path), prompts, [24, 24], outs)
    stats = llm.engine.stats().spec_decode
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_proposed_tokens
    assert_no_leaks(llm.engine)
