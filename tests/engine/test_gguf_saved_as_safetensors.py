"""A checkpoint saved by transformers after loading a GGUF file: float safetensors whose
config.json keeps ``quantization_config: {quant_method: "gguf", dequantize: false, ...}``, as
transformers 5.25 writes it. transformers loads the floats as they are; so does the engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers.utils.quantization_config import GgufConfig

from conveyor.engine.quantization.registry import scheme_from_config
from tests.engine.reference import assert_outputs_match, greedy

PROMPTS = ["The chef will bring", "Tea and cake"]
MAX_TOKENS = [12, 8]


def _gguf_noted(tiny: str, path: Path) -> str:
    shutil.copytree(tiny, path)
    cfg = json.loads((path / "config.json").read_text())
    # (as transformers serialises it: ``to_json_string`` of the quantizer's config)
    cfg["quantization_config"] = json.loads(GgufConfig(gguf_file="model.gguf").to_json_string())
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(path)


def test_gguf_noted_float_safetensors_load_as_their_floats(tiny_models, hf_reference, make_llm, tmp_path):
    path = _gguf_noted(tiny_models("llama"), tmp_path / "gguf-noted")
    quant = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "gguf" and quant["dequantize"] is False
    assert scheme_from_config({"quantization_config": quant}) is None
    llm = make_llm(path)
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, llm.generate(PROMPTS, greedy(MAX_TOKENS)))
