"""Quantized weights kept quantized and multiplied through the GEMM kernels of
``conveyor.kernels.quant_gemm`` (here in Triton's interpreter, as on a GPU they run compiled): the layers
hold the packed weights and scales only, and the model answers greedy token for token as
transformers does on the float weights the format stores (W8A8 formats: its layers' inputs
quantized by compressed-tensors' functions). GGUF's Q8_0 and Q4_K matrices are kept as the
file's bytes. A layout no kernel serves (GPTQ's activation order) stays dequantized."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.engine import SamplingParams
from conveyor.engine.quantization import kept
from conveyor.engine.quantization.kept import QuantizedLinearWeight
from conveyor.engine.quantization.kernel_weights import Q4KWeight, Q8_0Weight
from conveyor.engine.quantization.w8a8 import W8A8Weight
from tests.engine import quantized_checkpoints as qc
from tests.engine.quantized_checkpoints import FORMATS
from tests.engine.reference import assert_greedy_match, assert_outputs_match, greedy

PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours", "A"]
MAX_TOKENS = [8, 5, 6]

# The formats whose layouts the GEMM kernels serve (``FORMATS``' keys).
KEPT_FORMATS = [
    "fp8-block",
    "fp8-tensor-static",
    "awq",
    "gptq-sym",
    "ct-w4a16-asym",
    "ct-w8a16-fp8-channel",
    "ct-w8a8-fp8-channel",
]


@pytest.fixture
def keep_on_cpu(monkeypatch):
    monkeypatch.setattr(kept, "KEEP_ON_CPU", True)


def _linears(llm) -> list[QuantizedLinearWeight]:
    return [getattr(m, name) for m in llm.engine.runner.model.modules() for name in getattr(m, "quantized_linears", ())]


@pytest.mark.usefixtures("keep_on_cpu")
@pytest.mark.parametrize("fmt", KEPT_FORMATS)
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
@pytest.mark.parametrize(("qtype", "kernel"), [("Q8_0", Q8_0Weight), ("Q4_K", Q4KWeight)])
def test_gguf_kept_weights_answer_as_transformers_gguf_loader(qtype, kernel, tiny_models, tmp_path, make_llm):
    """A Llama GGUF file of Q8_0 or Q4_K matrices (Q/K rows un-permuted as the bytes are read)
    keeps every projection as the file's blocks; greedy tokens are transformers' GGUF loader's
    on the same file (which dequantizes it whole)."""
    from tests.engine.test_gguf import PROMPTS as IDS
    from tests.engine.test_gguf import _hf_greedy, write_gguf

    file = write_gguf(tiny_models("llama", hidden_size=256, intermediate_size=256), tmp_path / "m", qtype)
    llm = make_llm(str(file))
    linears = _linears(llm)
    assert linears and all(isinstance(w, QuantizedLinearWeight) and isinstance(w.kernel, kernel) for w in linears)
    bits = 8.5 if qtype == "Q8_0" else 4.5  # the file's bits per weight, scales included
    assert sum(w.kernel.nbytes() for w in linears) * 8 == bits * sum(w.numel() for w in linears)
    ids = IDS[:2]  # (the interpreter is slow)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
    for i, (out, ref) in enumerate(zip(outs, _hf_greedy(file, ids, 4), strict=True)):
        assert_greedy_match(out.token_ids, ref, f"{qtype} kept, prompt {i}")


# (W8A8: FP8 blocks with per-group dynamic input scales, and a static per-tensor input scale,
# split exactly; their layers quantize each rank's share of the inputs as the whole layer would.)
@pytest.mark.parametrize("fmt", ["awq", "ct-w8a16-fp8-channel", "gguf-q8_0", "fp8-block", "fp8-tensor-static"])
def test_two_ranks_keep_their_shards_quantized(fmt, tiny_models, tmp_path, hf_reference, make_llm, monkeypatch):
    """Tensor parallelism (two ranks, gloo) with kept weights: each rank holds its rows of
    q/k/v and gate/up and its input columns of o_proj and down_proj as packed integers, FP8
    or Q8_0 blocks with their scales (the splits fall on group and block boundaries), and
    the model answers as transformers does on the stored weights (its layers' inputs
    quantized where the format says so)."""
    from tests.engine.test_gguf import write_gguf

    monkeypatch.setenv(kept.KEEP_ON_CPU_ENV, "1")  # (for the other rank's process too)
    if fmt == "gguf-q8_0":
        model, reference = str(write_gguf(tiny_models("llama"), tmp_path / "m", "Q8_0")), None
    else:
        config, quantize = FORMATS[fmt]()
        quantized, reference = qc.write_quantized(tiny_models("llama"), tmp_path / fmt, config, quantize)
        model = str(quantized)
    llm = make_llm(model, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16)
    try:
        linears = _linears(llm)
        assert linears and all(isinstance(w, QuantizedLinearWeight) for w in linears)
        if fmt.startswith("fp8"):
            assert all(isinstance(w.kernel, W8A8Weight) for w in linears)
        # Rank 0's halves: o_proj's and down_proj's inputs, q/k/v's and gate/up's outputs.
        o_proj = llm.engine.runner.model.layers[0].self_attn.o_weight
        assert o_proj.shape == (64, 32) and o_proj.kernel.cols == 32
        outs = llm.generate(PROMPTS[:2], greedy(MAX_TOKENS[:2]))
    finally:
        llm.shutdown()
    if reference is None:  # GGUF: against our own single-rank model on the same file's dequantized weights
        monkeypatch.delenv(kept.KEEP_ON_CPU_ENV)
        dense = make_llm(model).generate(PROMPTS[:2], greedy(MAX_TOKENS[:2]))
        assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    else:
        oracle = qc.w8a8_oracle(hf_reference, quantized, reference)
        assert_outputs_match(oracle, PROMPTS[:2], MAX_TOKENS[:2], outs)


def test_a_row_parallel_layer_with_per_token_input_scales_is_not_split_as_w8a8():
    from conveyor.engine.distributed.sharding import Shard
    from conveyor.engine.quantization.activations import ActivationQuant
    from conveyor.engine.quantization.kernel_weights import Fp8Weight

    fp8 = Fp8Weight.per_row(torch.zeros(64, 64).to(torch.float8_e4m3fn), torch.ones(64))
    by_token = W8A8Weight.of(fp8, ActivationQuant("token"), None)
    by_group = W8A8Weight.of(fp8, ActivationQuant("group", 32), None)
    assert by_token is not None and by_group is not None
    # A rank's share of the inputs would set its own per-token scale: not the layer's arithmetic.
    assert by_token.splits_exactly(0) and not by_token.splits_exactly(1)
    assert by_group.splits_exactly(1) and by_group.take(Shard.cols(32, 32)).cols == 32
    with pytest.raises(ValueError, match="covers 32 inputs"):
        by_group.take(Shard.cols(16, 48))


def test_a_split_inside_a_scale_block_is_refused():
    from conveyor.engine.distributed.sharding import Shard
    from conveyor.engine.quantization.kernel_weights import Fp8Weight

    half = torch.zeros(8, 2, dtype=torch.float16)
    q4 = Q4KWeight(torch.zeros(8, 256, dtype=torch.uint8), torch.zeros(8, 24, dtype=torch.uint8), half, half)
    assert q4.cols == 512 and q4.take(Shard.cols(256, 256)).cols == 256
    with pytest.raises(ValueError, match=r"inputs \[128, 256\).*covers 256 inputs"):
        q4.take(Shard.cols(128, 128))
    fp8 = Fp8Weight.blocks(torch.zeros(64, 64).to(torch.float8_e4m3fn), torch.ones(2, 2), (32, 32))
    assert fp8 is not None
    rows = fp8.take(Shard.rows(32, 32))
    assert isinstance(rows, Fp8Weight) and rows.scale.shape == (1, 2)
    with pytest.raises(ValueError, match=r"output rows \[16, 48\).*covers 32 output rows"):
        fp8.take(Shard.rows(16, 32))


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
    from conveyor.engine.quantization.kernel_weights import Int4Weight

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


def test_experts_built_on_the_meta_device_get_memory_when_they_stay_dequantized():
    """Where the experts cannot stay in MXFP4 (here the CPU path; on a GPU, tensor parallelism),
    the meta experts a quantized load builds get memory at their first piece, and every later
    piece of them lands in that same memory."""
    from torch import nn

    class Experts(nn.Module):
        quantized_experts = ("gate_up",)

        def __init__(self) -> None:
            super().__init__()
            self.gate_up = nn.Parameter(torch.empty(2, 4, 6, device="meta"), requires_grad=False)

    model = Experts()
    meta = model.gate_up
    keeper = kept.KeptWeights(model, torch.device("cpu"))
    assert not keeper.experts_kept
    first = keeper.take(meta, 0, 1, object(), None)
    assert first is not None and not first.is_meta and first.device.type == "cpu"
    assert model.gate_up is first and keeper.take(meta, 1, 1, object(), None) is first
    first.data[0:2].fill_(1.0)
    assert keeper.install() == 0 and torch.equal(model.gate_up, torch.ones(2, 4, 6))
