"""Each quantized variant's published ``quantization_config`` (``tests/data/checkpoints/<family>/
quantization/``, sources in its ``SOURCES.md``) as the engine meets it: a random-weight model
shrunk from the family's published config (``shrunk_checkpoint``) is quantized in that format and
carries the published block unchanged but for its size fields (``group_size``,
``weight_block_size``: made to tile the tiny widths), and the engine answers greedy token for
token as transformers does in float32.

The references are those the quantized-checkpoint tests use (``test_quantized_checkpoints``,
``test_gpt_oss_mxfp4``), since transformers cannot run AWQ, GPTQ, compressed-tensors or FP8 on a
CPU: transformers on the float weights the format stores (dequantized from the integers before
they were packed, or by the compressed-tensors library), its linear layers' inputs quantized to
e4m3 by compressed-tensors' own functions where the format quantizes them (FP8 block, dynamic by
1 x block groups); for MXFP4, transformers' own MXFP4 loader on the released layout itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor.engine.quantization.kept import QuantizedLinearWeight
from conveyor.engine.quantization.registry import scheme_from_config
from conveyor.engine.quantization.w8a8 import W8A8Weight
from tests.engine import quantized_checkpoints as qc
from tests.engine.reference import assert_outputs_match, greedy
from tests.engine.shrunk_checkpoint import build_shrunk_checkpoint

CHECKPOINTS = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours", "Tea"]
MAX_TOKENS = [12, 8, 10]
# The tiny widths every quantized linear layer of the shrunk models has are multiples of 32.
GROUP = 32

# variant -> (the published file, the family whose published config the model is shrunk from)
VARIANTS = {
    "fp8-block": ("deepseek_v3/quantization/fp8_block.json", "qwen3"),
    "awq": ("qwen2_5/quantization/awq.json", "qwen2_5"),
    "gptq": ("qwen2_5/quantization/gptq.json", "qwen2_5"),
    "compressed-tensors-w4a16": ("qwen3/quantization/compressed_tensors_w4a16.json", "qwen3"),
    "mxfp4": ("gpt_oss/quantization/mxfp4.json", "gpt_oss"),
}


def published_block(variant: str) -> dict:
    """The variant's ``quantization_config`` as published (a whole config.json holds it as a key)."""
    data = json.loads((CHECKPOINTS / VARIANTS[variant][0]).read_text())
    return data.get("quantization_config", data)


def shrink_quantization(block: dict, fp8_block: int = GROUP) -> dict:
    """``block`` with its size fields made tiny; every other key as published."""
    out = json.loads(json.dumps(block))
    if isinstance(out.get("weight_block_size"), list):
        out["weight_block_size"] = [fp8_block, fp8_block]
    if isinstance(out.get("group_size"), int) and out["group_size"] > 0:
        out["group_size"] = GROUP
    for group in (out.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if isinstance(weights.get("group_size"), int) and weights["group_size"] > 0:
            weights["group_size"] = GROUP
    return out


def quantizer(block: dict) -> qc.Quantizer:
    """The writer of ``tests.engine.quantized_checkpoints`` for the format ``block`` describes."""
    method = block["quant_method"]
    if method == "fp8":
        rows, cols = block["weight_block_size"]
        return qc.fp8_block((rows, cols))
    if method == "awq":
        return qc.awq_gemm(block["group_size"])
    if method == "gptq":
        return qc.gptq(block["group_size"], sym=block["sym"], desc_act=block["desc_act"])
    if method == "compressed-tensors":
        (group,) = block["config_groups"].values()
        return qc.compressed_tensors({"weights": group["weights"]}, group.get("format") or block["format"])[1]
    raise AssertionError(f"no writer for {method}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_engine_reads_the_published_quantization_config(variant):
    published = published_block(variant)
    scheme = scheme_from_config({"quantization_config": published})
    assert scheme is not None and scheme.method == published["quant_method"]
    assert (CHECKPOINTS / "SOURCES.md").read_text().count(VARIANTS[variant][0]) >= 1, "no source named"


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if v != "mxfp4"))
def test_a_model_quantized_as_published_matches_transformers(variant, tmp_path, hf_reference, make_llm):
    assert_quantized_matches_transformers(
        variant, shrink_quantization(published_block(variant)), tmp_path, hf_reference, make_llm
    )


def test_fp8_blocks_narrower_than_the_kernels_tiles_still_quantize_activations(tmp_path, hf_reference, make_llm):
    # 8-wide blocks: fp8_block_gemm's K tiles (16 to 64 inputs) would straddle them, so the
    # layers emulate the product instead of dropping the inputs' rounding (weight-only).
    block = shrink_quantization(published_block("fp8-block"), fp8_block=8)
    assert_quantized_matches_transformers("fp8-block", block, tmp_path, hf_reference, make_llm)


def test_fp8_input_groups_that_do_not_tile_a_layer_are_refused():
    scheme = scheme_from_config({"quantization_config": shrink_quantization(published_block("fp8-block"))})
    assert scheme is not None
    weight = torch.zeros(64, 80).to(torch.float8_e4m3fn)  # 80 inputs: two 32-wide groups and a 16-wide rest
    with pytest.raises(ValueError, match=r"input groups of 32 .* do not tile a layer of 80 inputs"):
        scheme.kernel_weight({"weight": weight, "scale": torch.ones(2, 3)})


def assert_quantized_matches_transformers(variant: str, block: dict, tmp_path, hf_reference, make_llm) -> None:
    family = VARIANTS[variant][1]
    float_dir = build_shrunk_checkpoint(tmp_path / "float", CHECKPOINTS / family)
    quantized, reference = qc.write_quantized(float_dir, tmp_path / variant, block, quantizer(block))
    assert json.loads((quantized / "config.json").read_text())["quantization_config"] == block
    llm = make_llm(str(quantized), max_model_len=256)
    # Where the format quantizes the layers' inputs, the engine does too (as the reference does).
    w8a8 = [
        isinstance(getattr(m, name), QuantizedLinearWeight) and isinstance(getattr(m, name).kernel, W8A8Weight)
        for m in llm.engine.runner.model.modules()
        for name in getattr(m, "quantized_linears", ())
    ]
    assert w8a8 and all(kept == (qc.activation_args(block) is not None) for kept in w8a8), w8a8
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(qc.w8a8_oracle(hf_reference, quantized, reference), PROMPTS, MAX_TOKENS, outs)


def test_gpt_oss_released_as_mxfp4_matches_transformers(tmp_path, hf_reference, make_llm):
    block = shrink_quantization(published_block("mxfp4"))
    float_dir = build_shrunk_checkpoint(tmp_path / "float", CHECKPOINTS / "gpt_oss")
    released = qc.write_released_gpt_oss(float_dir, tmp_path / "released")
    config = json.loads((released / "config.json").read_text())
    config["quantization_config"] = block
    (released / "config.json").write_text(json.dumps(config, indent=2))
    outs = make_llm(str(released), max_model_len=256).generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(str(released)), PROMPTS, MAX_TOKENS, outs)


def test_a_compressed_tensors_config_with_pruned_experts_is_refused_by_name():
    block = published_block("compressed-tensors-w4a16")
    pruned = {**block, "moe_sparsity_config": {"method": "prune", "num_experts": [None, 4]}}
    with pytest.raises(ValueError, match="moe_sparsity_config"):
        scheme_from_config({"quantization_config": pruned})
