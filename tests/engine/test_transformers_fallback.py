"""``model_impl``: which forward pass runs a checkpoint, and what the transformers fallback refuses.
(Its outputs against transformers are in ``test_correctness`` and ``test_prefix_caching``.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conveyor.engine import EngineConfig, SamplingParams
from conveyor.engine.attention.torch_backend import TorchAttention
from conveyor.engine.models.loader import check_checkpoint
from conveyor.engine.models.transformers_fallback import _STEP, _Step, fallback_spec, paged_attention
from tests.engine.reference import assert_outputs_match

PROMPTS = ["The chef will bring", "Tea", "Seven guests wait at the table and the waiter pours cold water"]


def _edited_copy(src: str, dest: Path, **changes) -> str:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(changes)
    (dest / "config.json").write_text(json.dumps(cfg))
    return str(dest)


def test_transformers_on_llama_gives_the_native_tokens(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    native = make_llm(path, model_impl="native")
    fallback = make_llm(path, model_impl="transformers", block_size=4)
    assert native.engine.model_impl == "native" and fallback.engine.model_impl == "transformers"
    ours = fallback.generate(PROMPTS, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in native.generate(PROMPTS, params)]
    assert_outputs_match(hf_reference(path), PROMPTS, [30] * 3, ours)


def test_auto_picks_native_when_the_registry_has_the_architecture(tiny_models, make_llm):
    assert make_llm(tiny_models("qwen3")).engine.model_impl == "native"
    assert make_llm(tiny_models("granite")).engine.model_impl == "transformers"


def test_a_fallback_checkpoint_passes_the_submit_check(tiny_models):
    assert check_checkpoint(Path(tiny_models("granite"))).architecture == "GraniteForCausalLM"


def test_bad_model_impl_is_refused():
    with pytest.raises(ValueError, match=r"model_impl must be one of \('auto', 'native', 'transformers'\)"):
        EngineConfig("m", model_impl="hf")


def test_native_on_an_unsupported_architecture_says_so(tiny_models, make_llm):
    with pytest.raises(ValueError, match="architecture GPTNeoXForCausalLM is not supported; supported: Llama"):
        make_llm(tiny_models("gpt_neox"), model_impl="native")


@pytest.mark.parametrize("name", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_soft_capping_is_refused(name, tiny_models, make_llm, tmp_path):
    path = _edited_copy(tiny_models("granite"), tmp_path / "capped", **{name: 30.0})
    with pytest.raises(ValueError, match=f"{name}=30.0 is set; soft-capping is not supported"):
        make_llm(path)


def test_a_sliding_window_caps_max_model_len(tiny_models, hf_reference, make_llm, tmp_path):
    """A Mistral checkpoint with a 16-token window, through the fallback: the default
    max_model_len stays inside the window, and a longer one is refused."""
    path = _edited_copy(tiny_models("mistral"), tmp_path / "windowed", sliding_window=16)
    with pytest.raises(ValueError, match="max_model_len 64 exceeds the model's limit of 16 \\(its sliding window\\)"):
        make_llm(path, model_impl="transformers", max_model_len=64)
    llm = make_llm(path, model_impl="transformers")
    assert llm.engine.max_model_len == 16
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0))
    assert_outputs_match(hf_reference(path), PROMPTS[:2], [8, 8], outs)


def test_the_attention_function_refuses_what_it_cannot_compute():
    class Layer(torch.nn.Module):
        layer_idx = 0

    cache = torch.zeros(4, 4, 2, 8)
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="only inside a conveyor engine step"):
        paged_attention(Layer(), q, kv, kv, None)
    token = _STEP.set(_Step(TorchAttention(), [(cache, cache)], max_len=64))
    try:
        with pytest.raises(ValueError, match="sliding window of 16 tokens, smaller than max_model_len 64"):
            paged_attention(Layer(), q, kv, kv, None, sliding_window=16)
        with pytest.raises(ValueError, match="passes softcap"):
            paged_attention(Layer(), q, kv, kv, None, softcap=30.0)
        with pytest.raises(ValueError, match="do not match the KV cache"):
            paged_attention(Layer(), q, torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8), None)
    finally:
        _STEP.reset(token)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_kv_shared_layers": 2}, "num_kv_shared_layers=2: layers that read other layers' KV"),
        ({}, r"its layers have different KV shapes \(2 KV heads of 16, 1 KV heads of 32\)"),
    ],
    ids=["shared-kv", "per-layer-kv-shapes"],
)
def test_layers_of_other_kv_shapes_or_shared_kv_are_refused(tmp_path, fields, message):
    """Gemma 4 has neither a native forward pass nor a cache the fallback can give it: its full
    layers' KV heads and head size differ from its sliding layers', and later layers may read
    earlier layers' KV. Refused at load, naming why, instead of failing inside a step."""
    import transformers

    # (global_head_dim and num_global_key_value_heads are read from kwargs: untyped)
    fields = {"global_head_dim": 32, "num_global_key_value_heads": 1, **fields}
    config = transformers.Gemma4TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"] * 2,
        **fields,
    )
    config.architectures = ["Gemma4ForCausalLM"]
    config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=f"gemma4_text: {message}"):
        fallback_spec(tmp_path)
