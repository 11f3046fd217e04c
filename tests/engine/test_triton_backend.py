"""The ``triton`` attention backend: the engine's token-exact transformers tests through our
Triton kernels (on CPU in Triton's interpreter, set up by the root conftest), a direct
comparison with the ``torch`` backend, and how the backend is chosen.

The interpreter costs ~80 us per Triton op and program, so everything here is tiny: one
2-layer model with hidden size 64 (4 query heads over 2 KV heads of 16), short prompts,
at most 16 new tokens, blocks of 16.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.attention import AttentionMetadata, TorchAttention, create_backend
from tests.engine.reference import TIE_MARGIN, assert_greedy_match

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Compiled kernels on a GPU when the interpreter is off (CONVEYOR_TEST_GPU=1); else CPU.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

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
    from engine.triton_attention import TritonAttention

    assert isinstance(llm.engine.runner.backend, TritonAttention)
    return llm


def _check(hf, outs, prompts, max_tokens):
    assert len(outs) == len(prompts)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.finished and out.prompt_token_ids == hf.encode(prompt)
        assert_greedy_match(out.token_ids, hf.greedy(hf.encode(prompt), m), label=repr(prompt))


def _greedy(max_tokens, **kwargs):
    return [SamplingParams(max_tokens=m, temperature=0.0, **kwargs) for m in max_tokens]


# --------------------------------------------------------------------------- engine vs transformers
@needs_triton
def test_mixed_batch_matches_transformers_and_the_torch_backend(model, hf_reference, make_llm, monkeypatch):
    import kernels.paged_attention as pa

    splits = []
    choose = pa.choose_num_kv_splits
    monkeypatch.setattr(pa, "choose_num_kv_splits", lambda *a: splits.append(choose(*a)) or splits[-1])
    params = _greedy(MAX_TOKENS, logprobs=2)
    outs = _triton_llm(make_llm, model).generate(PROMPTS, params)
    _check(hf_reference(model), outs, PROMPTS, MAX_TOKENS)
    if DEVICE == "cpu":
        assert "Interpreted" in type(pa._paged_attn_kernel).__name__
        # Both kernel paths ran: split-KV for the small decode batches at the end, one split
        # for the prefill and the full decode batch (the interpreter assumes 8 SMs).
        assert 1 in splits and any(s > 1 for s in splits), splits

    # The same batch through the torch backend: same tokens, same logprobs.
    ref = make_llm(model, attention_backend="torch", device=DEVICE).generate(PROMPTS, params)
    for a, b in zip(outs, ref):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:  # only at a near-tie of the torch backend's top two
                top = sorted(b.logprobs[i].values(), reverse=True)
                assert top[0] - top[1] < TIE_MARGIN, (a.token_ids, b.token_ids)
                break
            assert a.logprobs[i][ta] == pytest.approx(b.logprobs[i][tb], abs=1e-4)
        else:
            assert len(a.token_ids) == len(b.token_ids)


@needs_triton
def test_chunked_prefill_under_a_small_token_budget(model, hf_reference, make_llm):
    llm = _triton_llm(make_llm, model, max_num_batched_tokens=8, max_num_seqs=4)
    scheduler = llm.engine.scheduler
    steps, original = [], scheduler.schedule

    def recording_schedule():
        out = original()
        steps.append([(r.num_computed_tokens, n, r.num_tokens) for r, n in zip(out.requests, out.num_new_tokens)])
        return out

    scheduler.schedule = recording_schedule
    prompts, max_tokens = PROMPTS[:4], [6, 4, 8, 3]
    outs = llm.generate(prompts, _greedy(max_tokens))
    _check(hf_reference(model), outs, prompts, max_tokens)
    assert all(sum(n for _, n, _ in s) <= 8 for s in steps), "token budget exceeded"
    # A later chunk attends over the earlier chunks in the cache (causal mask offset).
    assert any(c > 0 and n > 1 and c + n < t for s in steps for c, n, t in s), "no middle chunk"
    mixed = [s for s in steps if any(n == 1 and c + 1 == t for c, n, t in s) and any(n > 1 for _, n, _ in s)]
    assert mixed, "no step mixed a prefill chunk with decodes"


@needs_triton
def test_preemption_when_kv_cache_is_small(model, hf_reference, make_llm):
    # 4 blocks of 16 tokens: every request fits alone (at most 3 blocks), the batch does not.
    llm = _triton_llm(make_llm, model, num_kv_blocks=4)
    prompts, max_tokens = PROMPTS[:5], [16, 14, 16, 12, 16]
    outs = llm.generate(prompts, _greedy(max_tokens))
    _check(hf_reference(model), outs, prompts, max_tokens)
    assert llm.engine.stats().num_preemptions > 0


@needs_triton
def test_prefill_over_a_cached_prefix(model, hf_reference, make_llm):
    llm = _triton_llm(make_llm, model)
    hf = hf_reference(model)
    first = SHARED_PREFIX + " ten"
    second = SHARED_PREFIX + " hundred cold water and warm bread"
    out1 = llm.generate([first], _greedy([8]))[0]
    assert out1.num_cached_tokens == 0
    # Submitted after the first finished: its blocks are free but still cached.
    out2, out3 = llm.generate([second, first], _greedy([10, 8]))
    _check(hf, [out1, out2, out3], [first, second, first], [8, 10, 8])
    assert out2.num_cached_tokens >= 32  # the two full shared blocks
    assert len(out2.prompt_token_ids) - out2.num_cached_tokens > 1  # a real prefill on top
    assert out3.num_cached_tokens >= 32
    assert out3.token_ids == out1.token_ids


# --------------------------------------------------------------------------- backend vs backend
def _batch(num_q_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    """Decodes first (by context length), then a fresh prefill and a prefill over a cached
    prefix, as the model runner lays them out; caches hold random context, the rest NaN."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [(4, 1), (37, 1), (0, 9), (32, 5)]  # (cached tokens, new tokens)
    num_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in reqs)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"))
    v_cache = torch.full(cache_shape, float("nan"))
    max_blocks = max(-(-(c + n) // block_size) for c, n in reqs)
    tables = torch.zeros((len(reqs), max_blocks), dtype=torch.int32)  # block 0: never used
    slots = []
    for b, (c, n) in enumerate(reqs):
        for j in range(-(-(c + n) // block_size)):
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
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(qlens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), block_tables=tables, query_start_loc=qsl,
        seq_lens=torch.tensor(seqlens, dtype=torch.int32), max_query_len=max(qlens),
        max_seq_len=max(seqlens), num_decodes=2, query_lens_host=qlens, seq_lens_host=seqlens,
    )
    return q, k, v, k_cache, v_cache, meta


def _to(meta: AttentionMetadata, device) -> AttentionMetadata:
    fields = {f: getattr(meta, f) for f in AttentionMetadata.__dataclass_fields__}
    return AttentionMetadata(**{f: x.to(device) if torch.is_tensor(x) else x for f, x in fields.items()})


@needs_triton
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 16), (8, 1, 32)], ids=["gqa2", "mqa8"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_forward_agrees_with_the_torch_backend(num_q_heads, num_kv_heads, head_dim, splits):
    from engine.triton_attention import TritonAttention

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
    from engine.triton_attention import TritonAttention

    assert EngineConfig(model, attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model, attention_backend="flash")
    assert isinstance(create_backend("triton", torch.device("cpu")), TritonAttention)
    assert isinstance(create_backend("auto", torch.device("cpu")), TorchAttention)
    if torch.cuda.is_available():
        assert isinstance(create_backend("auto", torch.device("cuda")), TritonAttention)


def test_triton_missing_is_a_clear_error(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "engine.triton_attention", raising=False)
    with pytest.raises(ValueError, match="needs the triton package"):
        create_backend("triton", torch.device("cpu"))
    # "auto" falls back to the torch backend, even on CUDA.
    assert isinstance(create_backend("auto", torch.device("cuda")), TorchAttention)
    with pytest.raises(ValueError, match="needs the triton package"):
        LLM(model, device="cpu", dtype="float32", attention_backend="triton")


_FRESH_PROCESS = """
import sys
from engine import LLM, SamplingParams
stage = "init"
try:
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", attention_backend="triton")
    stage = "step"
    out = llm.generate(["The chef will bring"], SamplingParams(max_tokens=4, temperature=0))[0]
except RuntimeError as exc:
    print("ERROR", stage, exc)
else:
    import kernels.paged_attention as pa
    print("TOKENS", out.token_ids, type(pa._paged_attn_kernel).__name__)
"""


@needs_triton
def test_cpu_process_without_the_interpreter_variable(model, make_llm):
    """Triton picks its interpreter when first imported (transformers imports it while the
    engine loads), so outside the test suite ``TRITON_INTERPRET=1`` may come too late: the
    engine sets the interpreter up itself before anything imports triton."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, model], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith(("ERROR", "TOKENS"))][-1]
    expected = make_llm(model).generate(["The chef will bring"], _greedy([4]))[0].token_ids
    assert line == f"TOKENS {expected} InterpretedFunction", line
