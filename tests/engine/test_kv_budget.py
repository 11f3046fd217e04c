"""How much memory the KV cache takes: on CPU a default derived from the model (not a share
of RAM sized for max_num_seqs full-length sequences), an explicit budget on any device, and
a log line saying what was allocated and why."""

from __future__ import annotations

import logging

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.config import CPU_KV_TOKENS_PER_SEQ, EngineConfig


def _kv_bytes(llm: LLM) -> int:
    cache = llm.engine.runner.kv_cache
    return cache.numel() * cache.element_size()


def _weight_bytes(llm: LLM) -> int:
    return sum(t.numel() * t.element_size() for t in llm.engine.runner.model.state_dict().values())


def _token_bytes(llm: LLM) -> int:
    runner = llm.engine.runner
    return _kv_bytes(llm) // (runner.num_blocks * runner.block_size)


def test_a_tiny_model_on_cpu_gets_a_tiny_cache_that_still_fits_a_full_sequence(tiny_models) -> None:
    llm = LLM(tiny_models("llama"), device="cpu", dtype="float32")  # max_num_seqs=256 by default
    runner, max_len = llm.engine.runner, llm.engine.max_model_len
    capacity = runner.num_blocks * runner.block_size
    # One full-length sequence always fits; beyond that, no more bytes than the weights.
    assert capacity >= max_len
    assert _kv_bytes(llm) <= max(_weight_bytes(llm), max_len * _token_bytes(llm)) + runner.block_size * _token_bytes(
        llm
    )
    assert _kv_bytes(llm) < 64 * 2**20  # it was a quarter of free RAM, over 1 GiB here
    out = llm.generate(["a long enough prompt to need a few blocks " * 4], SamplingParams(max_tokens=4))
    assert out[0].finish_reason in ("stop", "length")


def test_on_cpu_the_default_follows_the_weights_up_to_what_max_num_seqs_can_use(tiny_models) -> None:
    # A model whose weights outweigh one full sequence's KV: the cache is the weights' size.
    model = tiny_models("llama", hidden_size=256, intermediate_size=1024)
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=128)
    weights, token = _weight_bytes(llm), _token_bytes(llm)
    assert weights > 128 * token
    block = llm.engine.runner.block_size * token
    assert weights - block < _kv_bytes(llm) <= weights
    # ... unless max_num_seqs sequences of a typical length need less.
    few = LLM(model, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2)
    assert _kv_bytes(few) == 2 * min(128, CPU_KV_TOKENS_PER_SEQ) * token


def test_kv_cache_memory_bytes_sets_the_budget_and_the_log_says_what_was_allocated(tiny_models, caplog) -> None:
    probe = LLM(tiny_models("llama"), device="cpu", dtype="float32", num_kv_blocks=1)
    block = _kv_bytes(probe)
    with caplog.at_level(logging.INFO, logger="conveyor.engine.runner.model_runner"):
        llm = LLM(tiny_models("llama"), device="cpu", dtype="float32", kv_cache_memory_bytes=300 * block + 7)
    assert llm.engine.runner.num_blocks == 300 and _kv_bytes(llm) == 300 * block
    line = next(r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage())
    assert "300 blocks" in line and f"{300 * block / 2**20:.1f} MiB" in line and "kv_cache_memory_bytes" in line


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1GiB"])
def test_a_bad_kv_cache_memory_bytes_is_named(bad) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be a positive integer"):
        EngineConfig(model="m", kv_cache_memory_bytes=bad)
