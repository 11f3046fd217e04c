"""Quantized checkpoints in each format, loaded and dequantized, answer greedy token for token
as transformers does on the float weights the format stores (float32, CPU), its layers' inputs
quantized to e4m3 by compressed-tensors' own functions where the format is W8A8 (the FP8
ones): transformers' own FP8 loader on the FP8 checkpoint itself; for the int4 formats, the weights dequantized from the
integers before they were packed (AWQ, GPTQ) or by the compressed-tensors library. The engine
conditions (requests joining, preemption, chunked prefill, prefix caching), tensor parallelism
and a mixture of experts run on one FP8 and one int4 checkpoint."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.engine.quantization.kept import QuantizedLinearWeight
from conveyor.engine.quantization.w8a8 import W8A8Weight
from tests.engine import quantized_checkpoints as qc
from tests.engine.helpers import assert_no_leaks
from tests.engine.quantized_checkpoints import FORMATS
from tests.engine.reference import assert_outputs_match, greedy, oracle_model

PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours", "Tea", "A"]
MAX_TOKENS = [16, 9, 20, 12]

# A per-tensor dynamic input scale is the max over the whole step's batch (as in vLLM): the
# oracle's batches (one prompt, then a token a step) are matched by serving one request at a time.
ONE_AT_A_TIME = {"fp8-tensor-dynamic"}


def quantized_model(tiny_models, tmp_path_factory, family: str, fmt: str):
    config, quantize = FORMATS[fmt]()
    return qc.write_quantized(tiny_models(family), tmp_path_factory.mktemp(f"{family}-{fmt}"), config, quantize)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantized_llama_matches_transformers_on_the_weights_it_stores(
    fmt, tiny_models, tmp_path_factory, hf_reference, make_llm
):
    quantized, reference = quantized_model(tiny_models, tmp_path_factory, "llama", fmt)
    kwargs = {"max_num_seqs": 1} if fmt in ONE_AT_A_TIME else {}
    llm = make_llm(str(quantized), **kwargs)
    # W8A8 weights stay e4m3 on the CPU too: their layers quantize their inputs.
    w8a8 = [
        isinstance(getattr(m, name), QuantizedLinearWeight) and isinstance(getattr(m, name).kernel, W8A8Weight)
        for m in llm.engine.runner.model.modules()
        for name in getattr(m, "quantized_linears", ())
    ]
    expected = qc.activation_args(FORMATS[fmt]()[0]) is not None
    assert w8a8 and all(kept == expected for kept in w8a8), w8a8
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(qc.w8a8_oracle(hf_reference, quantized, reference), PROMPTS, MAX_TOKENS, outs)


def test_transformers_own_fp8_loader_reads_the_weights_we_read(tiny_models, tmp_path_factory, hf_reference, make_llm):
    quantized, reference = quantized_model(tiny_models, tmp_path_factory, "llama", "fp8-block")
    theirs = dict(oracle_model(str(quantized)).named_parameters())
    for name, tensor in oracle_model(str(reference)).named_parameters():
        assert torch.equal(theirs[name], tensor), name
    outs = make_llm(str(quantized)).generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(qc.w8a8_oracle(hf_reference, quantized, quantized), PROMPTS, MAX_TOKENS, outs)


# One FP8 and one int4 checkpoint under each engine condition.
CONDITION_FORMATS = ["fp8-block", "ct-w4a16"]


@pytest.mark.parametrize("fmt", CONDITION_FORMATS)
def test_requests_joining_mid_flight(fmt, tiny_models, tmp_path_factory, hf_reference):
    quantized, reference = quantized_model(tiny_models, tmp_path_factory, "qwen3", fmt)
    engine = LLMEngine(EngineConfig(str(quantized), dtype="float32", device="cpu", max_num_seqs=2))
    finished, step, schedule = {}, 0, {0: [0, 1], 2: [2], 5: [3]}
    while step <= max(schedule) or engine.has_unfinished_requests():
        for i in schedule.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0))
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    outs = [finished[f"r{i}"] for i in range(len(PROMPTS))]
    assert_outputs_match(qc.w8a8_oracle(hf_reference, quantized, reference), PROMPTS, MAX_TOKENS, outs)
    assert_no_leaks(engine)


@pytest.mark.parametrize("fmt", CONDITION_FORMATS)
def test_preemption_chunked_prefill_and_prefix_caching(fmt, tiny_models, tmp_path_factory, hf_reference, make_llm):
    quantized, reference = quantized_model(tiny_models, tmp_path_factory, "qwen3", fmt)
    hf = qc.w8a8_oracle(hf_reference, quantized, reference)
    max_tokens = [m + 16 for m in MAX_TOKENS]
    # Few blocks: requests are preempted and recomputed; a small budget: prompts in chunks.
    llm = make_llm(str(quantized), block_size=4, num_kv_blocks=12, max_num_batched_tokens=6)
    outs = llm.generate(PROMPTS, greedy(max_tokens))
    assert_outputs_match(hf, PROMPTS, max_tokens, outs)
    assert llm.engine.stats().num_preemptions > 0
    # A second pass over the same prompts is served from the prefix cache.
    llm = make_llm(str(quantized), block_size=4)
    llm.generate(PROMPTS, greedy(MAX_TOKENS))
    again = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_outputs_match(hf, PROMPTS, MAX_TOKENS, again)


@pytest.mark.parametrize("fmt", CONDITION_FORMATS)
def test_quantized_experts_match_transformers(fmt, tiny_models, tmp_path_factory, hf_reference, make_llm):
    quantized, reference = quantized_model(tiny_models, tmp_path_factory, "qwen3_moe", fmt)
    outs = make_llm(str(quantized)).generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(qc.w8a8_oracle(hf_reference, quantized, reference), PROMPTS, MAX_TOKENS, outs)


def test_two_ranks_shard_a_quantized_checkpoint(tiny_models, tmp_path_factory, hf_reference, make_llm):
    quantized, reference = quantized_model(tiny_models, tmp_path_factory, "llama", "awq")
    llm = make_llm(str(quantized), tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16)
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    finally:
        llm.shutdown()
    assert_outputs_match(hf_reference(str(reference)), PROMPTS, MAX_TOKENS, outs)
