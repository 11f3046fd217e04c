"""Checkpoint resolution and loading: local directories, hub ids (from the hub cache, offline),
and clear errors for what cannot be loaded."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.models.phi3 import Phi3ForCausalLM
from conveyor.engine.models.registry import MODEL_CLASSES, SUPPORTED_ARCHITECTURES, model_class

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_hub_id_resolves_through_huggingface_hub(tiny_models, tmp_path, make_llm):
    local = tiny_models("llama")
    rev = "0" * 40
    repo = tmp_path / "hub" / "models--conveyor-test--tiny-llama"
    shutil.copytree(local, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    code = (
        "from conveyor.engine import LLM, SamplingParams\n"
        "llm = LLM('conveyor-test/tiny-llama', device='cpu')\n"
        "out = llm.generate('The chef', SamplingParams(max_tokens=6, temperature=0))[0]\n"
        "print(out.token_ids)\n"
        "try:\n    LLM('conveyor-test/missing')\nexcept ValueError as e:\n    print('ERROR', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    expected = make_llm(local).generate("The chef", SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    assert lines[0] == str(expected)
    assert lines[1].startswith("ERROR could not find model 'conveyor-test/missing'")


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_and_unexpected_weights_are_named(tiny_models, tmp_path):
    path = _copy(tiny_models("llama"), tmp_path / "m")
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing from the checkpoint.*layers\.1\.mlp\.up_proj"):
        LLMEngine(EngineConfig(str(path), device="cpu"))
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.gate_proj.weight"].clone()
    weights["model.layers.9.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.9\.extra\.weight'"):
        LLMEngine(EngineConfig(str(path), device="cpu"))


def test_unsupported_architectures_and_rope_are_refused(tiny_models, tmp_path):
    path = _copy(tiny_models("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelSpec.from_dicts({**cfg, "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"architecture GemmaForCausalLM is not supported; supported: Llama.*Phi3"):
        ModelSpec.from_dicts({**cfg, "architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        ModelSpec.from_dicts({**cfg, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}})
    with pytest.raises(ValueError, match="yarn scaling needs original_max_position_embeddings"):
        ModelSpec.from_dicts({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        LLMEngine(EngineConfig(str(path), device="cpu"))


def test_the_registry_has_a_forward_pass_for_each_supported_architecture(tiny_models):
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
    cfg = json.loads((Path(tiny_models("llama")) / "config.json").read_text())
    # The architectures entry picks the forward pass; without one the model_type does.
    assert model_class(ModelSpec.from_dicts(cfg)) is LlamaForCausalLM
    phi3 = ModelSpec.from_dicts({**cfg, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"]})
    assert model_class(phi3) is Phi3ForCausalLM
    assert ModelSpec.from_dicts({**cfg, "model_type": "phi3", "architectures": None}).architecture == "Phi3ForCausalLM"


def test_phi3_longrope_config_is_resolved_as_transformers_does(tiny_models):
    legacy = {  # a Phi-3 128k config.json: no factor, the original context beside the rope dict
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        **{"vocab_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1},
        **{"num_attention_heads": 4, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096},
        "partial_rotary_factor": 0.75,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 6, "long_factor": [4.0] * 6},
    }
    spec = ModelSpec.from_dicts(legacy)
    s = spec.rope_scaling
    assert (s["rope_type"], s["original_max_position_embeddings"], s["factor"]) == ("longrope", 4096, 32.0)
    assert s["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert spec.rotary_dim == 12
    short, scale = spec.rope_inv_freq(4096)
    long, _ = spec.rope_inv_freq(4097)
    assert short.shape == (6,) and torch.allclose(short, long * 4) and scale == s["attention_factor"]


def test_both_config_spellings_and_generation_config_eos(tiny_models):
    new = ModelSpec.from_pretrained(tiny_models("qwen3"))
    old = ModelSpec.from_pretrained(tiny_models("qwen3", legacy_config=True))
    assert new == old and new.rope_theta == 10000.0 and new.qk_norm and new.tie_word_embeddings
    assert len(new.eos_token_ids) == 2  # <|im_end|> and <|endoftext|> from generation_config.json
    scaled = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    a = ModelSpec.from_pretrained(tiny_models("llama", rope_scaling=scaled))
    b = ModelSpec.from_pretrained(tiny_models("llama", rope_scaling=scaled, legacy_config=True))
    assert a.rope_scaling == b.rope_scaling == scaled
