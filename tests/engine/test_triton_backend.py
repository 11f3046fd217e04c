"""The ``triton`` attention backend: the engine's token-exact transformers tests through our
Triton kernels (on CPU in Triton's interpreter, set up by the root conftest), a direct
comparison with the ``torch`` backend, and how the backend is chosen.

The interpreter costs ~80 us per Triton op and program, so everything here is tiny: one
2-layer model with hidden size 64 (4 query heads over 2 KV heads of 16), short prompts,
at most 16 new tokens, blocks of 16.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

from conveyor.engine import LLM, EngineConfig
from conveyor.engine.attention.base import AttentionMetadata
from conveyor.engine.attention.selector import create_backend
from conveyor.engine.attention.torch_backend import TorchAttention
from conveyor.engine.attention.triton_backend import TritonAttention, triton_available
from conveyor.kernels.interpreter import kernel_device, kernels_interpreted
from conveyor.kernels.utils import cdiv
from tests.engine.helpers import assert_chunked_prefill_steps, record_steps, spy
from tests.engine.reference import TIE_MARGIN, assert_outputs_match, greedy

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
# Compiled kernels on a GPU when the interpreter is off (CONVEYOR_TEST_GPU=1); else CPU.
DEVICE = kernel_device()

PROMPTS = [
    "The chef will bring",
    "Seven guests wait at the table and the waiter pours cold water while the kitchen",
    "Tea",
    "queue worker engine cache block page prompt model output shard job one two three four five six",
    "A",
    "Late guests ask the waiter about the menu, the bill, the tip and the sweet cake.",
]
MAX_TOKENS = [12, 5, 10, 16, 14, 1]  # the longest context decodes last, alone: split-KV
# 46 tokens with the llama tokenizer: two full blocks of 16 plus a partial one.
SHARED_PREFIX = (
    "The waiter brings the soup, the bread, the wine and the fish to the table while the chef "
    "tastes the sweet cake and the guests count one two three four five six seven eight nine"
)


@pytest.fixture
def model(tiny_models):
    return tiny_models("llama")


def _triton_llm(make_llm, path, **kwargs) -> LLM:
    llm = make_llm(path, attention_backend="triton", device=DEVICE, **kwargs)
    assert isinstance(llm.engine.runner.backend, TritonAttention)
    return llm


# --------------------------------------------------------------------------- engine vs transformers
@needs_triton
def test_mixed_batch_matches_transformers_and_the_torch_backend(model, hf_reference, make_llm, monkeypatch):
    import conveyor.kernels.paged_attention as pa

    choices = spy(monkeypatch, pa, "choose_num_kv_splits")
    params = greedy(MAX_TOKENS, logprobs=2)
    outs = _triton_llm(make_llm, model).generate(PROMPTS, params)
    assert_outputs_match(hf_reference(model), PROMPTS, MAX_TOKENS, outs)
    if DEVICE == "cpu":
        assert kernels_interpreted()
        # Both kernel paths ran: split-KV for the small decode batches at the end, one split
        # for the prefill and the full decode batch (the interpreter assumes 8 SMs).
        splits = [result for _, result in choices]
        assert 1 in splits and any(s > 1 for s in splits), splits

    # The same batch through the torch backend: same tokens, same logprobs.
    ref = make_llm(model, attention_backend="torch", device=DEVICE).generate(PROMPTS, params)
    for a, b in zip(outs, ref, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):  # lengths compared below
            if ta != tb:  # only at a near-tie of the torch backend's top two
                top = sorted(b.logprobs[i].values(), reverse=True)
                assert top[0] - top[1] < TIE_MARGIN, (a.token_ids, b.token_ids)
                break
            assert a.logprobs[i][ta] == pytest.approx(b.logprobs[i][tb], abs=1e-4)
        else:
            assert len(a.token_ids) == len(b.token_ids)


@needs_triton
def test_chunked_prefill_under_a_small_token_budget(model, hf_reference, make_llm, monkeypatch):
    llm = _triton_llm(make_llm, model, max_num_batched_tokens=8, max_num_seqs=4)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    prompts, max_tokens = PROMPTS[:4], [6, 4, 8, 3]
    outs = llm.generate(prompts, greedy(max_tokens))
    assert_outputs_match(hf_reference(model), prompts, max_tokens, outs)
    assert_chunked_prefill_steps(steps, budget=8)
    # A later chunk attends over the earlier chunks in the cache (causal mask offset).
    assert any(c > 0 and n > 1 and c + n < t for s in steps for c, n, t in s), "no middle chunk"


@needs_triton
def test_preemption_when_kv_cache_is_small(model, hf_reference, make_llm):
    # 4 blocks of 16 tokens: every request fits alone (at most 3 blocks), the batch does not.
    llm = _triton_llm(make_llm, model, num_kv_blocks=4)
    prompts, max_tokens = PROMPTS[:5], [16, 14, 16, 12, 16]
    outs = llm.generate(prompts, greedy(max_tokens))
    assert_outputs_match(hf_reference(model), prompts, max_tokens, outs)
    assert llm.engine.stats().num_preemptions > 0


@needs_triton
def test_prefill_over_a_cached_prefix(model, hf_reference, make_llm):
    llm = _triton_llm(make_llm, model)
    hf = hf_reference(model)
    first = SHARED_PREFIX + " ten"
    second = SHARED_PREFIX + " hundred cold water and warm bread"
    out1 = llm.generate([first], greedy([8]))[0]
    assert out1.num_cached_tokens == 0
    # Submitted after the first finished: its blocks are free but still cached.
    out2, out3 = llm.generate([second, first], greedy([10, 8]))
    assert_outputs_match(hf, [first, second, first], [8, 10, 8], [out1, out2, out3])
    assert out2.num_cached_tokens >= 32  # the two full shared blocks
    assert len(out2.prompt_token_ids) - out2.num_cached_tokens > 1  # a real prefill on top
    assert out3.num_cached_tokens >= 32
    assert out3.token_ids == out1.token_ids


@needs_triton
def test_gemma_sliding_windows_and_soft_caps(tiny_models, hf_reference, make_llm, monkeypatch):
    """Sliding layers (window 8, shorter than most prompts) beside full ones, Gemma 2's
    soft-capped scores, through the kernel: whole prefills, then chunked prefills whose later
    chunks attend over a window that starts inside the cache."""
    path = tiny_models("gemma2")
    prompts, max_tokens = PROMPTS[:4], [4, 3, 6, 8]
    outs = _triton_llm(make_llm, path).generate(prompts, greedy(max_tokens))
    assert_outputs_match(hf_reference(path), prompts, max_tokens, outs)
    llm = _triton_llm(make_llm, path, max_num_batched_tokens=8, max_num_seqs=4)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    assert_outputs_match(hf_reference(path), prompts, max_tokens, llm.generate(prompts, greedy(max_tokens)))
    assert any(c > 8 and n > 1 for s in steps for c, n, _ in s), "no chunk past the window"


@needs_triton
def test_gpt_oss_sinks_and_windows(tiny_models, hf_reference, make_llm, monkeypatch):
    """gpt-oss through the kernel: every head's sink in its softmax, sliding layers (window 8)
    beside full ones, whole and chunked prefills, decodes."""
    path = tiny_models("gpt_oss")
    prompts, max_tokens = PROMPTS[:4], [4, 3, 6, 8]
    outs = _triton_llm(make_llm, path).generate(prompts, greedy(max_tokens))
    assert_outputs_match(hf_reference(path), prompts, max_tokens, outs)
    llm = _triton_llm(make_llm, path, max_num_batched_tokens=8, max_num_seqs=4)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    assert_outputs_match(hf_reference(path), prompts, max_tokens, llm.generate(prompts, greedy(max_tokens)))
    assert any(c > 8 and n > 1 for s in steps for c, n, _ in s), "no chunk past the window"


@needs_triton
def test_deepseek_latent_decode_through_the_kernel(tiny_models, hf_reference, make_llm, monkeypatch):
    """DeepSeek-V3's decode rows through the Triton MLA kernel (in the latent space, over the
    latent cache): mixed lengths, then a prompt whose prefix is cached in blocks of 4."""
    path = tiny_models("deepseek_v3")
    hf = hf_reference(path)
    llm = _triton_llm(make_llm, path, block_size=4)
    calls = spy(monkeypatch, llm.engine.runner.backend, "mla_decode")
    prompts, max_tokens = PROMPTS[:4], [6, 3, 8, 10]
    assert_outputs_match(hf, prompts, max_tokens, llm.generate(prompts, greedy(max_tokens)))
    assert max(args[0].shape[0] for args, _ in calls) > 1  # batched decodes ran through the kernel
    for suffix in (" tea", " cake"):
        out = llm.generate([SHARED_PREFIX + suffix], greedy([5]))
        assert_outputs_match(hf, [SHARED_PREFIX + suffix], [5], out)
    assert out[0].num_cached_tokens > 0


# --------------------------------------------------------------------------- backend vs backend
def _batch(num_q_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    """Decodes first (by context length), then a fresh prefill and a prefill over a cached
    prefix, as the model runner lays them out; caches hold random context, the rest NaN."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [(4, 1), (37, 1), (0, 9), (32, 5)]  # (cached tokens, new tokens)
    num_blocks = 1 + sum(cdiv(c + n, block_size) for c, n in reqs)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"))
    v_cache = torch.full(cache_shape, float("nan"))
    max_blocks = max(cdiv(c + n, block_size) for c, n in reqs)
    tables = torch.zeros((len(reqs), max_blocks), dtype=torch.int32)  # block 0: never used
    slots = []
    for b, (c, n) in enumerate(reqs):
        for j in range(cdiv(c + n, block_size)):
            tables[b, j] = perm.pop()
        pos = torch.arange(c + n)
        flat = tables[b, pos // block_size].long() * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[flat[:c]] = torch.randn(c, num_kv_heads, head_dim, generator=gen)
        v_cache.view(-1, num_kv_heads, head_dim)[flat[:c]] = torch.randn(c, num_kv_heads, head_dim, generator=gen)
        slots.append(flat[c:])
    T = sum(n for _, n in reqs)
    q = torch.randn(T, num_q_heads, head_dim, generator=gen)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    qlens, seqlens = [n for _, n in reqs], [c + n for c, n in reqs]
    meta = AttentionMetadata.from_host(
        torch.cat(slots).tolist(), tables.tolist(), qlens, seqlens, num_decodes=2, device=torch.device("cpu")
    )
    return q, k, v, k_cache, v_cache, meta


def _to(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    return dataclasses.replace(
        meta,
        slot_mapping=meta.slot_mapping.to(device),
        block_tables=meta.block_tables.to(device),
        query_start_loc=meta.query_start_loc.to(device),
        seq_lens=meta.seq_lens.to(device),
    )


@needs_triton
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 16), (8, 1, 32)], ids=["gqa2", "mqa8"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_forward_agrees_with_the_torch_backend(num_q_heads, num_kv_heads, head_dim, splits):
    q, k, v, k_cache, v_cache, meta = _batch(num_q_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    # The torch backend reads whole blocks: give it zeros where the triton one sees NaN.
    ref_k, ref_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    torch_backend = TorchAttention()
    torch_backend.prepare(meta)
    expected = torch_backend.forward(q, k, v, ref_k, ref_v, scale)

    backend = TritonAttention(DEVICE)
    backend.num_kv_splits = splits
    dev_k, dev_v = k_cache.to(DEVICE, copy=True), v_cache.to(DEVICE, copy=True)
    backend.prepare(_to(meta, DEVICE))
    out = backend.forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), dev_k, dev_v, scale).cpu()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # New K/V landed in their slots, and nothing else in the caches changed.
    torch.testing.assert_close(dev_k.cpu().nan_to_num(0.0), ref_k, atol=0, rtol=0)
    torch.testing.assert_close(dev_v.cpu().nan_to_num(0.0), ref_v, atol=0, rtol=0)
    assert dev_k.cpu().isnan().sum() == k_cache.isnan().sum() - k.numel()


# --------------------------------------------------------------------------- choosing the backend
@needs_triton
def test_choosing_the_triton_backend(model):
    assert EngineConfig(model, attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model, attention_backend="flash")
    # (on CPU the kernels run in the interpreter, which a GPU run turns off)
    assert isinstance(create_backend("triton", torch.device(DEVICE)), TritonAttention)
    assert isinstance(create_backend("auto", torch.device("cpu")), TorchAttention)
    if torch.cuda.is_available():
        assert isinstance(create_backend("auto", torch.device("cuda")), TritonAttention)


def test_an_unknown_backend_name_is_an_error():
    """Built directly (no EngineConfig to check first), the selector refuses it by name."""
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*'auto', 'torch', 'triton'"):
        create_backend("flash", torch.device("cpu"))


def test_triton_missing_is_a_clear_error(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(ValueError, match="needs the triton package"):
        create_backend("triton", torch.device("cpu"))
    # "auto" falls back to the torch backend, even on CUDA.
    assert isinstance(create_backend("auto", torch.device("cuda")), TorchAttention)
    with pytest.raises(ValueError, match="needs the triton package"):
        LLM(model, device="cpu", dtype="float32", attention_backend="triton")


_FRESH_PROCESS = """
import sys
from conveyor.engine import LLM, SamplingParams
stage = "init"
try:
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", attention_backend="triton")
    stage = "step"
    out = llm.generate(["The chef will bring"], SamplingParams(max_tokens=4, temperature=0))[0]
except RuntimeError as exc:
    print("ERROR", stage, exc)
else:
    import conveyor.kernels.paged_attention as pa
    print("TOKENS", out.token_ids, type(pa._paged_attn_kernel).__name__)
"""


@needs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="a CPU process's interpreter set-up; a GPU run tests compiled kernels")
def test_cpu_process_without_the_interpreter_variable(model, make_llm):
    """Triton picks its interpreter when first imported (transformers imports it while the
    engine loads), so outside the test suite ``TRITON_INTERPRET=1`` may come too late: the
    engine sets the interpreter up itself before anything imports triton."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, model], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith(("ERROR", "TOKENS"))][-1]
    expected = make_llm(model).generate(["The chef will bring"], greedy([4]))[0].token_ids
    assert line == f"TOKENS {expected} InterpretedFunction", line
