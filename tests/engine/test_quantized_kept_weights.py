"""Quantized weights kept quantized and multiplied through the GEMM kernels of
``kernels.quant_gemm`` (here in Triton's interpreter, as on a GPU they run compiled): the layers
hold the packed weights and scales only, and the model answers greedy token for token as
transformers does on the float weights the format stores (W8A8 formats: its layers' inputs
quantized by compressed-tensors' functions). A layout no kernel serves (GPTQ's
activation order) stays dequantized."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from engine.quantization import kept
from engine.quantization.kept import QuantizedLinearWeight
from tests.engine import quantized_checkpoints as qc
from tests.engine.reference import assert_outputs_match, greedy

PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours", "A"]
MAX_TOKENS = [8, 5, 6]

FORMATS: dict[str, Callable[[], tuple[dict, qc.Quantizer]]] = {
    "fp8-block": lambda: (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 32]},
        qc.fp8_block((16, 32)),
    ),
    "fp8-tensor": lambda: (
        {"quant_method": "fp8", "activation_scheme": "static"},
        qc.with_input_scale(qc.fp8_tensor),
    ),
    "awq": lambda: (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        qc.awq_gemm(32),
    ),
    "gptq-sym": lambda: (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
        qc.gptq(32, sym=True, desc_act=False),
    ),
    "ct-w4a16-asym": lambda: qc.compressed_tensors(
        {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}},
        "pack-quantized",
    ),
    "ct-w8a16-fp8-channel": lambda: qc.compressed_tensors(
        {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}},
        "float-quantized",
    ),
    "ct-w8a8-fp8-channel-token": lambda: qc.compressed_tensors(
        {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        },
        "float-quantized",
    ),
}


@pytest.fixture
def keep_on_cpu(monkeypatch):
    monkeypatch.setattr(kept, "KEEP_ON_CPU", True)


def _linears(llm) -> list[QuantizedLinearWeight]:
    return [getattr(m, name) for m in llm.engine.runner.model.modules() for name in getattr(m, "quantized_linears", ())]


@pytest.mark.usefixtures("keep_on_cpu")
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_kept_weights_answer_as_transformers_on_the_stored_weights(
    fmt, tiny_models, tmp_path_factory, hf_reference, make_llm
):
    config, quantize = FORMATS[fmt]()
    quantized, reference = qc.write_quantized(tiny_models("llama"), tmp_path_factory.mktemp(fmt), config, quantize)
    llm = make_llm(str(quantized))
    linears = _linears(llm)
    assert linears and all(isinstance(w, QuantizedLinearWeight) for w in linears)
    # No float copy of those weights is left: the model holds the packed weights and scales.
    float_bytes = sum(w.numel() * 4 for w in linears)
    kept_bytes = sum(w.kernel.nbytes() for w in linears)
    assert kept_bytes < float_bytes / 3
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(qc.w8a8_oracle(hf_reference, quantized, reference), PROMPTS, MAX_TOKENS, outs)


@pytest.mark.usefixtures("keep_on_cpu")
def test_activation_order_stays_dequantized(tiny_models, tmp_path_factory, make_llm):
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True}
    quantized, _ = qc.write_quantized(
        tiny_models("llama"), tmp_path_factory.mktemp("desc-act"), config, qc.gptq(32, sym=False, desc_act=True)
    )
    linears = _linears(make_llm(str(quantized)))
    assert linears and not any(isinstance(w, QuantizedLinearWeight) for w in linears)


def test_the_cpu_path_dequantizes_unless_forced(tiny_models, tmp_path_factory, make_llm):
    config, quantize = FORMATS["awq"]()
    quantized, _ = qc.write_quantized(tiny_models("llama"), tmp_path_factory.mktemp("awq-cpu"), config, quantize)
    linears = _linears(make_llm(str(quantized)))
    assert linears and not any(isinstance(w, QuantizedLinearWeight) for w in linears)


def test_a_kept_weight_multiplies_through_f_linear_only():
    from engine.quantization.kernel_weights import Int4Weight

    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 64), generator=g)
    scales, zeros = torch.rand(24, 2, generator=g), torch.randint(0, 16, (24, 2), generator=g)
    kernel = Int4Weight.from_groups(q, scales, zeros)
    assert kernel is not None and kernel.group_size == 32 and kernel.qweight.shape == (24, 8)
    weight = QuantizedLinearWeight(kernel, torch.float32, torch.device("cpu"))
    x, bias = torch.randn(3, 5, 64, generator=g), torch.randn(24, generator=g)
    dequantized = (q - zeros.repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    torch.testing.assert_close(F.linear(x, weight, bias), F.linear(x, dequantized, bias), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match=r"serves F\.linear only"):
        _ = weight + 1
