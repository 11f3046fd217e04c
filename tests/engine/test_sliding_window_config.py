"""Which layers slide, and Gemma's fields, read from config.json in each spelling, as
transformers' own config classes resolve them (no checkpoint needed)."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from conveyor.engine.models.model_config import ModelSpec

BASE: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
)


def _spec(config) -> ModelSpec:
    cfg = config.to_dict()
    cfg["architectures"] = [type(config).__name__.replace("Config", "ForCausalLM").replace("TextFor", "For")]
    return ModelSpec.from_dicts(cfg)


def _hf_windows(config) -> list[int | None]:
    """The window transformers gives each layer: its ``layer_types`` if the family has them,
    else the config's window for every layer."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize(
    "config",
    [
        transformers.MistralConfig(**BASE, num_hidden_layers=3, sliding_window=16),
        transformers.MistralConfig(**BASE, num_hidden_layers=3, sliding_window=None),
        transformers.Qwen2Config(
            **BASE, num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2
        ),
        transformers.Qwen2Config(**BASE, num_hidden_layers=4, use_sliding_window=False, sliding_window=16),
        transformers.Qwen2MoeConfig(
            **BASE, num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=3
        ),
        transformers.Gemma2Config(**BASE, num_hidden_layers=4, head_dim=8, sliding_window=16),
        transformers.Gemma3TextConfig(**BASE, num_hidden_layers=7, head_dim=8, sliding_window=16),
    ],
    ids=["mistral", "mistral-none", "qwen2", "qwen2-off", "qwen2_moe", "gemma2", "gemma3"],
)
def test_layer_windows_follow_transformers(config):
    spec = _spec(config)
    assert [spec.layer_window(i) for i in range(spec.num_layers)] == _hf_windows(config)


def _without_layer_types(config) -> dict:
    cfg = config.to_dict()
    del cfg["layer_types"]
    return cfg


def test_older_configs_without_layer_types():
    """Configs written before ``layer_types``: Gemma 3's ``sliding_window_pattern`` (every n-th
    layer full), Gemma 2's alternation, Qwen2's ``max_window_layers``."""
    gemma3 = transformers.Gemma3TextConfig(**BASE, num_hidden_layers=7, head_dim=8, sliding_window=16)
    cfg = {**_without_layer_types(gemma3), "sliding_window_pattern": 3, "architectures": ["Gemma3ForCausalLM"]}
    spec = ModelSpec.from_dicts(cfg)
    assert [spec.layer_window(i) for i in range(7)] == [16, 16, None, 16, 16, None, 16]
    gemma2 = transformers.Gemma2Config(**BASE, num_hidden_layers=4, head_dim=8, sliding_window=16)
    spec = ModelSpec.from_dicts({**_without_layer_types(gemma2), "architectures": ["Gemma2ForCausalLM"]})
    assert [spec.layer_window(i) for i in range(4)] == _hf_windows(gemma2) == [16, None, 16, None]
    qwen2 = transformers.Qwen2Config(
        **BASE, num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    spec = ModelSpec.from_dicts({**_without_layer_types(qwen2), "architectures": ["Qwen2ForCausalLM"]})
    assert [spec.layer_window(i) for i in range(4)] == _hf_windows(qwen2) == [None, 16, 16, 16]


def test_gemma3_rope_in_both_spellings():
    """transformers 5.x: one rope_parameters entry per layer type; 4.x: rope_theta and
    rope_scaling for full layers, rope_local_base_freq for sliding ones."""
    new = transformers.Gemma3TextConfig(
        **BASE,
        num_hidden_layers=2,
        head_dim=8,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5000.0},
        },
    )
    spec = _spec(new)
    assert (spec.local_rope_theta, spec.rope_theta) == (20.0, 5000.0)
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    old = {k: v for k, v in new.to_dict().items() if k != "rope_parameters"}
    old.update(rope_theta=5000.0, rope_local_base_freq=20.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    old_spec = ModelSpec.from_dicts({**old, "architectures": ["Gemma3ForCausalLM"]})
    assert (old_spec.local_rope_theta, old_spec.rope_theta, old_spec.rope_scaling) == (20.0, 5000.0, spec.rope_scaling)


def test_gemma_fields():
    g2 = _spec(transformers.Gemma2Config(**BASE, num_hidden_layers=2, head_dim=8, query_pre_attn_scalar=144))
    assert (g2.query_pre_attn_scalar, g2.attn_logit_softcap, g2.final_logit_softcap) == (144.0, 50.0, 30.0)
    assert g2.hidden_act == "gelu_pytorch_tanh" and not g2.qk_norm
    # Gemma 3's attention never soft-caps, whatever the config says.
    g3 = _spec(transformers.Gemma3TextConfig(**BASE, num_hidden_layers=2, head_dim=8, attn_logit_softcapping=5.0))
    assert g3.attn_logit_softcap is None and g3.qk_norm


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        ({"layer_types": ["sliding_attention"]}, "layer_types has 1 entries for 2 layers"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ],
)
def test_unsupported_gemma_configs_are_refused(change, message):
    cfg = transformers.Gemma2Config(**BASE, num_hidden_layers=2, head_dim=8).to_dict()
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_dicts({**cfg, **change, "architectures": ["Gemma2ForCausalLM"]})
