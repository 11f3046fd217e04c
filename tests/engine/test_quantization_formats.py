"""Each format's dequantization against an independent reference (transformers' MXFP4
conversion, the compressed-tensors library, the published block arithmetic), and what is
refused at load with the scheme or option named."""

from __future__ import annotations

import json

import pytest
import torch

from engine.models.loader import check_checkpoint
from engine.quantization import scheme_from_config
from engine.quantization.fp8 import Fp8Scheme
from engine.quantization.loading import dequantized
from engine.quantization.mxfp4 import Mxfp4Scheme
from tests.engine import quantized_checkpoints as qc


def test_mxfp4_matches_transformers_conversion_under_gpt_oss_names():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    experts, rows, groups = 3, 10, 4  # [experts, outputs, inputs / 32, 16 bytes]
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.randint(
            0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=generator
        ),
        "model.layers.0.mlp.experts.gate_up_proj_scales": torch.randint(
            117, 137, (experts, rows, groups), dtype=torch.uint8, generator=generator
        ),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(experts, rows),
        "model.layers.0.mlp.router.weight": torch.randn(experts, 128),
    }
    scheme = scheme_from_config({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}})
    assert isinstance(scheme, Mxfp4Scheme)
    sources = dict.fromkeys(tensors, "model.safetensors")
    loaded = {name: read(None) for _, name, read in dequantized(scheme, sources, tensors.__getitem__)}
    assert set(loaded) == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
        "model.layers.0.mlp.router.weight",
    }
    expected = convert_moe_packed_tensors(
        tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"],
        tensors["model.layers.0.mlp.experts.gate_up_proj_scales"],
        dtype=torch.float32,
    )
    ours = loaded["model.layers.0.mlp.experts.gate_up_proj"]
    assert ours.shape == (experts, groups * 32, rows)  # transformers' [experts, in, out]
    assert torch.equal(ours, expected)


def test_fp8_blocks_cut_short_at_the_edges_follow_the_block_arithmetic():
    generator = torch.Generator().manual_seed(1)
    rows, cols, block = 40, 72, (16, 32)  # 3 x 3 blocks, the last of each dim short
    weight = (torch.randn(rows, cols, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, generator=generator) + 0.5
    ours = Fp8Scheme({"weight_block_size": list(block)}).dequantize({"weight": weight, "scale": scale})
    for r in range(rows):
        for c in range(cols):
            assert ours[r, c] == weight[r, c].float() * scale[r // block[0], c // block[1]]


@pytest.mark.parametrize(
    ("weights", "fmt"),
    [
        ({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}, "pack-quantized"),
        ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": False}, "pack-quantized"),
        ({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}, "float-quantized"),
    ],
)
def test_compressed_tensors_dequantize_as_the_library_decompresses(weights, fmt):
    config, quantize = qc.compressed_tensors({"weights": weights}, fmt)
    scheme = scheme_from_config({"quantization_config": config})
    assert scheme is not None
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    parts, expected = quantize(w)
    tensors = {"layer" + suffix: t for suffix, t in parts.items()}
    (quantized,) = scheme.find(tensors)
    assert quantized.name == "layer.weight"
    ours = scheme.dequantize({role: tensors[name] for role, name in quantized.parts.items()})
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, w)  # quantized: the check is not vacuous


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fp8_fast_mode": True}, "fp8_fast_mode"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "awq", "bits": 3}, "bits=3"),
        ({"quant_method": "gptq", "bits": 3}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}},
                "sparsity_config": {"format": "sparse-24-bitmask"},
            },
            "sparsity_config",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}
                },
            },
            "config_groups.g",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}},
                "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": True},
            },
            "kv_cache_scheme",
        ),
    ],
)
def test_unknown_schemes_and_options_are_refused_by_name(config, named):
    with pytest.raises(ValueError, match="quant") as info:
        scheme_from_config({"quantization_config": config})
    assert named in str(info.value)


def test_a_checkpoint_with_an_unsupported_scheme_is_refused_at_check(tiny_models, tmp_path):
    quantized, _ = qc.write_quantized(
        tiny_models("llama"), tmp_path, {"quant_method": "awq", "version": "gemv"}, qc.awq_gemm(32)
    )
    with pytest.raises(ValueError, match="version='gemv'"):
        check_checkpoint(quantized)


def test_an_fp8_weight_without_its_scale_is_refused():
    tensors = {"a.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "norm.weight": torch.ones(4)}
    scheme = Fp8Scheme({"weight_block_size": [2, 2]})
    readers = {name: read for _, name, read in dequantized(scheme, dict.fromkeys(tensors, "f"), tensors.__getitem__)}
    assert torch.equal(readers["norm.weight"](None), torch.ones(4))
    with pytest.raises(ValueError, match=r"a\.weight: a torch\.float8_e4m3fn tensor"):
        readers["a.weight"](None)


def test_a_scale_without_its_weight_is_refused():
    with pytest.raises(ValueError, match=r"lacks a\.weight"):
        Fp8Scheme({"weight_block_size": [2, 2]}).find(["a.weight_scale_inv"])


def test_a_quantized_architecture_without_a_native_forward_is_refused(tiny_models, tmp_path):
    from engine.models.loader import load_spec

    quantized, _ = qc.write_quantized(tiny_models("gpt_neox"), tmp_path, {"quant_method": "fp8"}, qc.fp8_tensor)
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    with pytest.raises(ValueError, match="runs natively only"):
        load_spec(quantized)
