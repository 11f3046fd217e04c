"""Checkpoint resolution and loading: local directories, hub ids (from the hub cache, offline),
and clear errors for what cannot be loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.model_config import ModelSpec

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
        "from engine import LLM, SamplingParams\n"
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
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelSpec.from_dicts({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        LLMEngine(EngineConfig(str(path), device="cpu"))


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
