"""``kv_cache_dtype="fp8"``: K/V stored as e4m3 (scale 1), read back by the torch attention
backend and by the triton one (its kernels in the interpreter here); the memory budget
counts one byte an element. Teacher-forced against transformers: each generated token's
logprob under ours and under transformers' float32 forward over the same tokens, where
transformers' attention gets its keys and values rounded through e4m3 (an attention
function registered with its ``AttentionInterface``), agrees within ``FP8_LOGPROB_BOUND``;
the same engine with the model's dtype agrees with plain transformers to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.reference import oracle_model

PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours cold water", "Tea"]
# The largest difference of a token's logprob from transformers' with e4m3-rounded K/V.
FP8_LOGPROB_BOUND = 1e-2


def _fp8_kv_attention(module, query, key, value, *args, **kwargs):
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn).to(x.dtype)

    return eager_attention_forward(module, query, rounded(key), rounded(value), *args, **kwargs)


def _logprob_errors(llm: LLM, path: str, fp8_reference: bool = False, max_tokens: int = 24) -> list[float]:
    if fp8_reference:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        # Eager attention's additive mask too (a new name would get SDPA's boolean one).
        AttentionInterface.register("conveyor_fp8_kv_eager", _fp8_kv_attention)
        AttentionMaskInterface.register("conveyor_fp8_kv_eager", eager_mask)
        hf = oracle_model(path)
        hf.set_attn_implementation("conveyor_fp8_kv_eager")
    else:
        hf = oracle_model(path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1))
    errors = []
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logprobs = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.logprobs is not None
        for i, (token, ours) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            theirs = float(logprobs[len(out.prompt_token_ids) + i - 1, token])
            errors.append(abs(ours[token] - theirs))
    return errors


def test_fp8_kv_cache_logprobs_stay_within_the_bound(tiny_models, make_llm):
    path = tiny_models("qwen3")
    # Small blocks and budget: decodes read the cache, prompts are chunked and preempted.
    kwargs = {"block_size": 4, "max_num_batched_tokens": 8}
    exact = _logprob_errors(make_llm(path, **kwargs), path)
    fp8_llm = make_llm(path, kv_cache_dtype="fp8", **kwargs)
    fp8 = _logprob_errors(fp8_llm, path, fp8_reference=True)
    against_exact = _logprob_errors(fp8_llm, path)
    print(
        f"logprob error: model dtype {max(exact):.1e}; fp8 KV {max(fp8):.1e} vs e4m3-rounded "
        f"transformers, {max(against_exact):.2f} vs plain transformers"
    )
    assert max(exact) < 1e-3
    assert max(fp8) < FP8_LOGPROB_BOUND
    assert max(against_exact) > 10 * FP8_LOGPROB_BOUND  # the FP8 cache is really what is read


def test_the_budget_counts_one_byte_per_element(tiny_models, make_llm):
    path = tiny_models("llama")
    budget = 1 << 20
    auto = make_llm(path, kv_cache_memory_bytes=budget)
    fp8 = make_llm(path, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.engine.runner.num_blocks == 4 * auto.engine.runner.num_blocks  # float32: 4 bytes -> 1


def test_the_triton_backend_reads_the_fp8_cache_within_the_bound(tiny_models, make_llm):
    path = tiny_models("qwen3")
    llm = make_llm(path, kv_cache_dtype="fp8", attention_backend="triton", block_size=4, max_num_batched_tokens=8)
    fp8 = _logprob_errors(llm, path, fp8_reference=True, max_tokens=12)
    print(f"logprob error: fp8 KV through the triton kernels {max(fp8):.1e} vs e4m3-rounded transformers")
    assert max(fp8) < FP8_LOGPROB_BOUND


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM("unused", kv_cache_dtype="int8")
