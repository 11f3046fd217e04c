"""Tensor parallelism on CPU (gloo, two ranks): the same greedy tokens as one process and as
transformers, a rank that dies ending ``generate`` with an error instead of a hang, and bad
sizes refused with a clear error."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conveyor.engine import LLM, EngineConfig, EngineDeadError, SamplingParams
from conveyor.engine.distributed.parallel_state import ParallelState
from conveyor.engine.distributed.rank_group import RankGroup
from conveyor.engine.distributed.sharding import Shard, check_tensor_parallel, head_shard, vocab_shard
from conveyor.engine.models.model_config import ModelSpec
from conveyor.testing.tiny_models import build_truncated_draft
from tests.engine.helpers import model_case
from tests.engine.reference import assert_outputs_match, greedy

PROMPTS = [
    "The chef brings warm bread to the guest at the table by the window",
    "One two three",
    "Queue worker engine cache block page prompt model output shard job batch token",
]
MAX_TOKENS = [16, 24, 8]
# A small step budget: prompts are prefilled in chunks, mixed with other requests' decodes.
ENGINE_KWARGS = {"max_num_batched_tokens": 16, "block_size": 4}


def ranks_of(llm: LLM) -> RankGroup:
    ranks = llm.engine.runner.ranks
    assert isinstance(ranks, RankGroup)
    return ranks


@pytest.mark.parametrize(
    ("family", "build"),
    [
        # One KV head for two ranks: each rank keeps a copy; tied embeddings (one vocab-parallel tensor).
        ("llama", {"num_kv_heads": 1, "tie_word_embeddings": True}),
        # Experts split by their intermediate dim; q/k norm; an LM head of its own.
        ("qwen3_moe", {}),
        # GLM-4.5: the float32 router whole on every rank, the ungated shared expert split too.
        ("glm4_moe", {}),
        # gpt-oss: sinks split with their heads, interleaved gate/up columns, biased experts
        # (the down bias added on one rank), o_proj's bias once.
        ("gpt_oss", {}),
        # SmolLM3: NoPE layers (sliding) among RoPE ones, biases on q/k/v/o.
        ("smollm3", {}),
        # OLMo 3: q/k norms over all heads (the sums of squares added over the ranks; the one
        # KV head on both ranks), post-block norms, RoPE per layer type.
        ("olmo3", {"num_kv_heads": 1}),
    ],
)
def test_two_ranks_match_one_process_and_transformers(tiny_models, hf_reference, make_llm, family, build):
    path = tiny_models(family, **build)
    single = make_llm(path, **ENGINE_KWARGS).generate(PROMPTS, greedy(MAX_TOKENS))
    llm = make_llm(path, tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        assert llm.engine.runner.num_kv_heads == 1  # each rank caches its own KV heads only
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
        # A second pass hits the prefix cache kept by rank 0's block manager for every rank's KV.
        again = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    assert [o.token_ids for o in again] == [o.token_ids for o in single]
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_two_ranks_run_gemma_as_one_process_does(tiny_models, make_llm, family):
    """Gemma's own layers (scaled embedding, GELU MLP, soft caps, sliding layers) split too."""
    path = tiny_models(family)
    single = make_llm(path, **ENGINE_KWARGS).generate(PROMPTS, greedy(MAX_TOKENS))
    llm = make_llm(path, tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]


@pytest.mark.parametrize("case", ["gemma4", "gemma4-moe"])
def test_two_ranks_split_gemma4_per_layer_kind(tiny_models, hf_reference, make_llm, case):
    """Gemma 4: query heads and each kind's KV heads split (the full layers' one KV head on both
    ranks), the shared-KV layers reading their rank's share of an earlier layer's cache, the
    MLP's and the MoE block's experts' intermediate dims split (their sums added over the ranks
    before the post-norm), the per-layer inputs whole on every rank."""
    path, kwargs = model_case(tiny_models, case)
    single = make_llm(path, **ENGINE_KWARGS, **kwargs).generate(PROMPTS, greedy(MAX_TOKENS))
    llm = make_llm(path, tensor_parallel_size=2, **ENGINE_KWARGS, **kwargs)
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
        again = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    assert [o.token_ids for o in again] == [o.token_ids for o in single]
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_two_ranks_split_qwen3_5s_linear_attention_heads_and_state(tiny_models, hf_reference, make_llm, family):
    """Qwen3.5 (dense and MoE) and Qwen3-Next: each rank keeps one of the two key heads with its
    two value heads (their rows of the projections, fused per key head in Qwen3-Next's, their
    conv channels, decay and norm), and state slots for those heads only; the gated full
    attention's heads and the experts split as the other models'. Prefill chunks run mixed
    with decodes; ``make_llm`` checks that no KV block and no state slot is left held."""
    path, kwargs = model_case(tiny_models, family)
    llm = make_llm(path, tensor_parallel_size=2, **ENGINE_KWARGS, **kwargs)
    try:
        state = llm.engine.runner.state_cache
        assert state is not None
        assert state.conv[0].shape[1:] == (2 * 16 + 2 * 8, 3) and state.recurrent[0].shape[1:] == (2, 16, 8)
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    finally:
        llm.shutdown()
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)


def test_two_ranks_verify_ngram_proposals_as_one_process_does(tiny_models, make_llm):
    path = tiny_models("llama", num_kv_heads=1)
    # Prompts that repeat themselves, so prompt lookup finds something to propose.
    prompts = [p + " " + p for p in PROMPTS]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    single = make_llm(path, **ENGINE_KWARGS).generate(prompts, greedy(MAX_TOKENS))
    llm = make_llm(path, tensor_parallel_size=2, speculative_config=spec, **ENGINE_KWARGS)
    try:
        outs = llm.generate(prompts, greedy(MAX_TOKENS))
        stats = llm.engine.stats().spec_decode
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    assert stats is not None and stats.num_proposed_tokens > 0


def test_two_ranks_give_the_prompt_logprobs_one_process_does(tiny_models, make_llm):
    path = tiny_models("llama", num_kv_heads=1)
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    single = make_llm(path, **ENGINE_KWARGS).generate(PROMPTS, params)
    llm = make_llm(path, tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        outs = llm.generate(PROMPTS, params)
    finally:
        llm.shutdown()
    for ours, one in zip(outs, single, strict=True):
        assert ours.prompt_logprobs is not None and one.prompt_logprobs is not None
        assert len(ours.prompt_logprobs) == len(one.prompt_logprobs) == len(one.prompt_token_ids)
        for a, b in zip(ours.prompt_logprobs[1:], one.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_a_draft_model_runs_whole_on_rank_0_beside_a_split_target(tiny_models, make_llm, tmp_path):
    """The draft is not split: it runs on rank 0 alone (its layers make no collective call),
    proposing for the target the ranks verify together; the tokens are one process's."""
    path = tiny_models("llama", num_kv_heads=1)
    draft = build_truncated_draft(path, tmp_path / "draft", num_layers=1)
    spec = {"method": "draft", "model": str(draft), "num_speculative_tokens": 3}
    single = make_llm(path, **ENGINE_KWARGS).generate(PROMPTS, greedy(MAX_TOKENS))
    llm = make_llm(path, tensor_parallel_size=2, speculative_config=spec, **ENGINE_KWARGS)
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
        stats = llm.engine.stats().spec_decode
        speculator = llm.engine.speculator
        assert speculator is not None and speculator.draft is not None
        draft_layers = [m for m in speculator.draft.model.modules() if hasattr(m, "tp")]
        assert draft_layers and all(m.tp.world_size == 1 for m in draft_layers)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    assert stats is not None and stats.num_accepted_tokens > 0


def test_a_dead_rank_ends_generate_with_an_error(tiny_models, monkeypatch):
    llm = LLM(tiny_models("llama"), device="cpu", dtype="float32", tensor_parallel_size=2)
    ranks = ranks_of(llm)
    try:
        engine = llm.engine
        [pid] = ranks.pids
        step, steps = engine.step, []

        def step_then_kill():
            steps.append(1)
            if len(steps) == 3:  # mid-run: requests are running on both ranks
                os.kill(pid, signal.SIGKILL)
            return step()

        monkeypatch.setattr(engine, "step", step_then_kill)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
            llm.generate(PROMPTS, greedy([64] * len(PROMPTS)))
        # A hang guard, not a speed test: the failure shows in seconds, never a collective timeout.
        assert time.monotonic() - start < 30
        assert len(steps) >= 3
        with pytest.raises(EngineDeadError, match="rank 1 died"):  # later steps fail at once
            llm.generate(PROMPTS[:1], greedy([4]))
    finally:
        llm.shutdown()
    assert not ranks.procs[0].is_alive()


def test_shutdown_stops_the_ranks(tiny_models):
    llm = LLM(tiny_models("llama"), device="cpu", dtype="float32", tensor_parallel_size=2)
    [proc] = ranks_of(llm).procs
    assert proc.is_alive()
    # The layers read the process's one parallel state: no second engine beside it.
    for size in (1, 2):
        with pytest.raises(RuntimeError, match="a tensor-parallel engine is already running in this process"):
            LLM(tiny_models("llama"), device="cpu", dtype="float32", tensor_parallel_size=size)
    llm.shutdown()
    assert proc.exitcode == 0  # it stopped when told, not killed
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(PROMPTS[:1], greedy([4]))
    # The process can start another tensor-parallel engine afterwards; one whose rank dies
    # while it is idle fails its next step at once.
    other = LLM(tiny_models("llama"), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        [pid] = ranks_of(other).pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
            other.generate(PROMPTS[:1], greedy([4]))
        assert time.monotonic() - start < 30
    finally:
        other.shutdown()
    # An engine nobody shuts down stops its ranks when it is garbage-collected.
    third = LLM(tiny_models("llama"), device="cpu", dtype="float32", tensor_parallel_size=2)
    [proc] = ranks_of(third).procs
    del third
    gc.collect()
    proc.join(10)
    assert proc.exitcode == 0


# Rank 0 builds a two-rank engine, prints rank 1's pid, then dies without any cleanup.
_ORPHANING_SCRIPT = """
import os, signal, sys
from conveyor.engine import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
    print(llm.engine.runner.ranks.pids[0], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_the_ranks_exit_when_rank_0_dies(tiny_models, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(_ORPHANING_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, str(script), tiny_models("llama")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid), f"rank 1 (pid {pid}) outlived rank 0"


@pytest.mark.parametrize("size", [0, -1, 1.5, "2", True, None])
def test_tensor_parallel_size_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model="m", tensor_parallel_size=size)


def test_tensor_parallel_size_is_at_most_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    EngineConfig(model="m", device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 needs 4 GPUs, but 2 are visible"):
        EngineConfig(model="m", device="cuda", tensor_parallel_size=4)


def test_sizes_that_do_not_divide_the_model_are_refused(tiny_models):
    spec = ModelSpec.from_pretrained(tiny_models("qwen3_moe"))  # 4 heads, 2 KV heads, experts of 32
    check_tensor_parallel(spec, 4)  # 4 ranks, 2 KV heads: each KV head on two ranks
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's num_attention_heads 4"):
        check_tensor_parallel(spec, 3)
    odd = dataclasses.replace(spec, num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads 3 \(nor does 2 divide by it\)"):
        check_tensor_parallel(odd, 2)
    assert spec.moe is not None
    moe = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate_size=30))
    with pytest.raises(ValueError, match="the experts' intermediate size 30"):
        check_tensor_parallel(moe, 4)
    # Through the engine: refused before any rank starts.
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads 4"):
        LLM(tiny_models("llama"), device="cpu", dtype="float32", tensor_parallel_size=3)


def test_gemma4_kinds_that_do_not_split_are_refused(tiny_models):
    spec = ModelSpec.from_pretrained(tiny_models("gemma4"))  # sliding: 2 KV heads of 16; full: 1 of 48
    assert spec.gemma4 is not None
    check_tensor_parallel(spec, 2)
    three = dataclasses.replace(spec.gemma4, sliding_kv_heads=3)
    with pytest.raises(ValueError, match=r"does not divide the model's sliding_attention layers' KV heads 3"):
        check_tensor_parallel(dataclasses.replace(spec, num_heads=6, gemma4=three), 2)
    # Sliding layers of 2 KV heads of 32 size the slot (64 values; 32 a rank): a full layer's one
    # KV head of 48, whole on each rank, would not fit it.
    wide = dataclasses.replace(spec.gemma4, sliding_head_dim=32)
    with pytest.raises(ValueError, match=r"full_attention layers' KV heads 1 of 48 \(a rank's share outgrows"):
        check_tensor_parallel(dataclasses.replace(spec, num_kv_heads=2, head_dim=32, gemma4=wide), 2)
    moe = dataclasses.replace(spec.gemma4, num_experts=4, top_k_experts=2, moe_intermediate_size=30)
    with pytest.raises(ValueError, match="moe_intermediate_size 30"):
        check_tensor_parallel(dataclasses.replace(spec, gemma4=moe), 4)


def test_qwen3_5_linear_heads_that_do_not_split_are_refused(tiny_models):
    path, _ = model_case(tiny_models, "qwen3_5")  # linear layers: 2 key heads, 4 value heads
    spec = ModelSpec.from_pretrained(path)
    assert spec.linear_attention is not None
    check_tensor_parallel(spec, 2)
    # 4 ranks divide the full-attention layers' 4 heads (2 KV heads, each on two ranks), not
    # the 2 key heads: a rank would hold half a key head's value heads.
    with pytest.raises(ValueError, match=r"does not divide the model's linear_num_key_heads 2; pick a size"):
        check_tensor_parallel(spec, 4)
    odd = dataclasses.replace(spec.linear_attention, num_k_heads=3, num_v_heads=6)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's linear_num_key_heads 3"):
        check_tensor_parallel(dataclasses.replace(spec, linear_attention=odd), 2)


def test_the_transformers_fallback_is_not_split(tiny_models):
    with pytest.raises(ValueError, match="tensor parallelism needs a native model"):
        LLM(tiny_models("llama"), device="cpu", dtype="float32", tensor_parallel_size=2, model_impl="transformers")


def test_each_rank_keeps_the_kv_head_its_query_heads_use():
    # 8 query heads in 2 groups of 4 (KV heads 0 and 1), over 4 ranks of 2 query heads each.
    shards = [head_shard(8, 2, ParallelState(rank, 4)) for rank in range(4)]
    assert [(s.head_start, s.num_heads) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.kv_head_start, s.num_kv_heads) for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    for s in shards:  # transformers' grouping: query head h attends with KV head h // (8 // 2)
        assert {h // 4 for h in range(s.head_start, s.head_start + s.num_heads)} == {s.kv_head_start}
    # As many KV heads as ranks or more: split like the query heads.
    assert [head_shard(8, 4, ParallelState(r, 2)).kv_head_start for r in range(2)] == [0, 2]


def test_the_vocabulary_is_padded_to_equal_rows_per_rank():
    shards = [vocab_shard(10, ParallelState(rank, 3)) for rank in range(3)]
    assert [(s.start, s.rows, s.padded) for s in shards] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]


def test_a_shard_takes_its_rows_or_columns_of_a_checkpoint_tensor():
    t = torch.arange(24).reshape(6, 4)
    assert torch.equal(Shard.rows(2, 2).take(t), t[2:4])
    assert torch.equal(Shard.cols(1, 2).take(t), t[:, 1:3])
    # A fused tensor's parts (Phi-3's qkv): one range from each, concatenated.
    assert torch.equal(Shard(0, ((0, 1), (3, 2))).take(t), torch.cat([t[0:1], t[3:5]]))
    assert Shard(0, ((0, 2), (2, 4))).take(t) is t  # ranges covering it all: the tensor itself
    with pytest.raises(ValueError, match="does not match the config"):
        Shard.rows(5, 2).take(t)


def test_a_rank_reads_only_its_shard_from_a_safetensors_file(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from conveyor.engine.models.loader import _read_safetensor

    t = torch.randn(6, 4)
    save_file({"w": t}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt", device="cpu") as f:
        for shard in (Shard.rows(2, 3), Shard.cols(1, 2), Shard(0, ((0, 1), (3, 2))), Shard.rows(0, 6)):
            assert torch.equal(_read_safetensor(f, "w", shard), shard.take(t))
        assert torch.equal(_read_safetensor(f, "w", None), t)
