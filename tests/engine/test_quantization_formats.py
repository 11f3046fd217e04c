"""Each format's dequantization against an independent reference (transformers' MXFP4
conversion, the compressed-tensors library, the published block arithmetic), and what is
refused at load with the scheme or option named."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conveyor.engine.models.loader import check_checkpoint
from conveyor.engine.quantization import scheme_from_config
from conveyor.engine.quantization.fp8 import Fp8Scheme
from conveyor.engine.quantization.loading import dequantized
from conveyor.engine.quantization.mxfp4 import Mxfp4Scheme
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


def _w8a8(input_activations: dict) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": {"weights": weights, "input_activations": input_activations}},
    }


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
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "activation_scheme='static'",
        ),
        (_w8a8({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "input_activations"),
        (_w8a8({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}), "input_activations"),
        (_w8a8({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": "local"}), "input_activations"),
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


@pytest.mark.parametrize(
    "args",
    [
        {"strategy": "tensor", "dynamic": False},
        {"strategy": "tensor", "dynamic": True},
        {"strategy": "token", "dynamic": True},
        {"strategy": "group", "group_size": 32, "dynamic": True},
    ],
)
def test_w8a8_layers_quantize_their_inputs_as_compressed_tensors_does(args):
    """A W8A8 weight's product on the CPU: the input fake-quantized by compressed-tensors'
    ``calculate_qparams`` / ``fake_quantize`` (the static scale: the checkpoint's), times the
    dequantized weight, in float32."""
    from compressed_tensors.quantization import QuantizationArgs  # type: ignore[import-untyped]
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # type: ignore[import-untyped]
    from compressed_tensors.quantization.utils import calculate_qparams  # type: ignore[import-untyped]

    from conveyor.engine.quantization.kept import QuantizedLinearWeight
    from conveyor.engine.quantization.w8a8 import W8A8Weight

    act = {"num_bits": 8, "type": "float", "symmetric": True, **args}
    scheme = scheme_from_config({"quantization_config": _w8a8(act)})
    assert scheme is not None and scheme.quantizes_activations
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g) * 3
    x[1] = 0  # an all-zero token: its scale is eps, not a division by zero
    weight_scale = w.abs().amax(-1, keepdim=True) / 448
    parts = {"weight": (w / weight_scale).to(torch.float8_e4m3fn), "scale": weight_scale}
    if not args["dynamic"]:
        parts["input_scale"] = torch.tensor([2.5 / 448])  # some inputs clip
    kernel = scheme.kernel_weight(parts)
    assert kernel is not None
    ours = F.linear(x, QuantizedLinearWeight(kernel, torch.float32, torch.device("cpu")))

    qargs = QuantizationArgs(**act)
    if not args["dynamic"]:
        scale = parts["input_scale"]
    elif args["strategy"] == "token":
        scale, _ = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), qargs)
    elif args["strategy"] == "group":
        groups = x.reshape(5, -1, 32)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), qargs)
    else:
        scale, _ = calculate_qparams(x.amin(), x.amax(), qargs)
    x_q = fake_quantize(x, scale, torch.zeros_like(scale), qargs)
    assert isinstance(kernel, W8A8Weight)
    ours_q = kernel.act.quantize(x, kernel.act.scale(x, kernel.segments[0][1]))
    assert torch.equal(kernel.act.dequantize(ours_q, kernel.act.scale(x, kernel.segments[0][1])), x_q)
    # The product: float32 matmuls of the same operands (their summation order may differ).
    expected = x_q @ (parts["weight"].float() * weight_scale).t()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(x_q, x, rtol=1e-3, atol=1e-3)  # the input was rounded: not vacuous


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
    from conveyor.engine.models.loader import load_spec

    quantized, _ = qc.write_quantized(tiny_models("gpt_neox"), tmp_path, {"quant_method": "fp8"}, qc.fp8_tensor)
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    with pytest.raises(ValueError, match="runs natively only"):
        load_spec(quantized)


@pytest.mark.parametrize(("strategy", "dynamic"), [("tensor", False), ("token", True)])
def test_scaled_mm_takes_the_w8a8_operands_as_the_emulation_multiplies_them(strategy, dynamic):
    """The operands and scales given to ``torch._scaled_mm`` (per tensor; per token by per
    channel) give the emulated product: run here through its CPU implementation (on a GPU it
    is cuBLASLt's; the arguments are the same)."""
    from conveyor.engine.quantization import w8a8

    act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic}
    scheme = scheme_from_config({"quantization_config": _w8a8(act)})
    assert scheme is not None
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g) * 3
    weight_scale = w.abs().amax(-1, keepdim=True) / 448 if dynamic else w.abs().amax().reshape(1) / 448
    parts = {"weight": (w / weight_scale).to(torch.float8_e4m3fn), "scale": weight_scale}
    if not dynamic:
        parts["input_scale"] = torch.tensor([2.5 / 448])
    kernel = scheme.kernel_weight(parts)
    assert isinstance(kernel, w8a8.W8A8Weight) and kernel.uniform == (not dynamic)
    scale = kernel.act.scale(x, kernel.segments[0][1])
    out = w8a8._scaled_mm(kernel.act.quantize(x, scale), kernel.weight, scale, torch.float32, kernel.uniform)
    torch.testing.assert_close(out, kernel.matmul(x), rtol=1e-5, atol=1e-5)
