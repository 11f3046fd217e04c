"""Gemma 3 and Gemma 4 as released: the multimodal ``*ForConditionalGeneration`` checkpoints
run their language model natively (the vision and audio towers' tensors skipped), answering
greedy token for token as transformers' text model does on the same weights (float32, CPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.models.multimodal import language_model_name
from conveyor.testing.tiny_models import build_tiny_multimodal_gemma
from tests.engine.helpers import model_case
from tests.engine.reference import assert_outputs_match, greedy

PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours cold water", "Tea", "A"]
MAX_TOKENS = [16, 9, 20, 12]


@pytest.mark.parametrize("case", ["gemma3", "gemma3-tied", "gemma4", "gemma4-moe"])
def test_multimodal_checkpoint_runs_its_language_model(case, tiny_models, hf_reference, make_llm, tmp_path):
    text_model, kwargs = model_case(tiny_models, case)
    wrapper = str(build_tiny_multimodal_gemma(tmp_path / case, text_model))
    config = json.loads(Path(wrapper, "config.json").read_text())
    assert config["architectures"][0].endswith("ForConditionalGeneration")
    llm = make_llm(wrapper, **kwargs)  # model_impl auto: native, the towers' tensors skipped
    assert llm.engine.model_impl == "native"
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    # transformers' text model (Gemma3ForCausalLM, Gemma4ForCausalLM) on the same weights
    assert_outputs_match(hf_reference(text_model), PROMPTS, MAX_TOKENS, outs)


def test_transformers_multimodal_model_answers_the_same_on_text(tiny_models, hf_reference, make_llm, tmp_path):
    text_model, kwargs = model_case(tiny_models, "gemma4")
    wrapper = str(build_tiny_multimodal_gemma(tmp_path / "gemma4", text_model))
    outs = make_llm(wrapper, **kwargs).generate(PROMPTS[:2], greedy(MAX_TOKENS[:2]))
    assert_outputs_match(hf_reference(wrapper), PROMPTS[:2], MAX_TOKENS[:2], outs)


def test_released_gemma3_text_config_names_only_what_differs(tiny_models, tmp_path):
    # Gemma 3's released config.json gives six text_config keys; transformers' defaults fill the rest.
    text_model = tiny_models("gemma3")
    wrapper = build_tiny_multimodal_gemma(tmp_path / "gemma3", text_model, released=True)
    text_config = json.loads((wrapper / "config.json").read_text())["text_config"]
    assert "rms_norm_eps" not in text_config and "rope_parameters" in text_config
    ours, theirs = ModelSpec.from_pretrained(wrapper), ModelSpec.from_pretrained(text_model)
    assert dataclasses.replace(ours, eos_token_ids=theirs.eos_token_ids) == theirs


def test_only_the_towers_are_skipped():
    assert (
        language_model_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    )
    assert language_model_name("model.language_model.norm.weight") == "model.norm.weight"
    assert language_model_name("language_model.lm_head.weight") == "lm_head.weight"
    assert language_model_name("lm_head.weight") == "lm_head.weight"
    for tower in (
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "multi_modal_projector.mm_input_projection_weight",
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",
        "model.audio_tower.output_proj.weight",
        "model.embed_vision.embedding_projection.weight",
        "model.embed_audio.embedding_projection.weight",
    ):
        assert language_model_name(tower) is None, tower


def test_two_ranks_split_a_multimodal_checkpoints_language_model(tiny_models, hf_reference, make_llm, tmp_path):
    text_model, kwargs = model_case(tiny_models, "gemma4")
    wrapper = str(build_tiny_multimodal_gemma(tmp_path / "gemma4", text_model))
    llm = make_llm(wrapper, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16, **kwargs)
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    finally:
        llm.shutdown()
    assert_outputs_match(hf_reference(text_model), PROMPTS, MAX_TOKENS, outs)
