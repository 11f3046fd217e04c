"""Gemma 4 (text): what the cache holds and how configs are read. (Greedy tokens against
transformers in the engine's conditions are in test_correctness.py and test_prefix_caching.py,
bf16 logits in test_bf16_logits.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.engine.models.gemma4 import Gemma4ForCausalLM
from conveyor.engine.models.model_config import ModelSpec
from tests.engine.reference import assert_outputs_match, greedy

PROMPTS = ["The chef will bring the soup to the table", "Tip the waiter"]
MAX_TOKENS = [20, 12]


def test_shared_kv_layers_own_no_cache(tiny_models, hf_reference, make_llm):
    """Four layers, the last two reading layers 0 and 1's KV: the cache holds two layers, each
    token's slot the larger kind's K/V (the full layers' one head of 48 over the sliding
    layers' two of 16), and a cache sized in bytes holds as many blocks as two layers allow."""
    path = tiny_models("gemma4")
    spec = ModelSpec.from_pretrained(path)
    assert spec.gemma4 is not None and spec.gemma4.num_kv_shared_layers == 2
    assert [spec.gemma4.kv_source(i) for i in range(4)] == [0, 1, 0, 1]
    assert (spec.kv_cache_layers, spec.num_kv_heads, spec.head_dim) == (2, 1, 48)
    block_bytes = 2 * 2 * 4 * 48 * 4  # layers, K and V, block size, slot, float32
    llm = make_llm(path, block_size=4, kv_cache_memory_bytes=100 * block_bytes)
    runner = llm.engine.runner
    assert isinstance(runner.model, Gemma4ForCausalLM)
    assert tuple(runner.kv_cache.shape) == (2, 2, 100, 4, 1, 48)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)


def _config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def test_published_config_spelling_reads_the_same(tiny_models):
    """A released config names the full layers' shape (``global_head_dim``,
    ``num_global_key_value_heads``); transformers 5.x saves it per layer instead."""
    cfg = _config(tiny_models("gemma4"))
    published = {k: v for k, v in cfg.items() if k != "per_layer_config"}
    published.update(global_head_dim=48, num_global_key_value_heads=1)
    assert ModelSpec.from_dicts(published) == ModelSpec.from_dicts(cfg)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 2}, "no earlier layer storing it"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope type 'yarn' is not supported"),
    ],
    ids=["shared-kind-without-producer", "rope-type"],
)
def test_configs_it_cannot_run_exactly_are_refused(tiny_models, change, message):
    cfg = {**_config(tiny_models("gemma4")), **change}
    cfg.pop("per_layer_config")
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_dicts(cfg)
