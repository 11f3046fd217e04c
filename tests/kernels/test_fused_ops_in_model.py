"""The models' CUDA path runs the Triton RMSNorm (with the residual add after attention fused
in) and SiLU-and-mul: ``kernel_ops`` picks them for CUDA with the triton attention backend,
and a model running them gives the torch references' tokens and logprobs.

Without a GPU the CUDA path's choice is applied to a CPU engine and its kernels run in
Triton's interpreter; with one (``CONVEYOR_TEST_GPU=1``) the engine on CUDA must have chosen
them by itself."""

from __future__ import annotations

from collections import Counter

import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.models.layers import MLP, RMSNorm, kernel_ops, use_kernel_ops
from conveyor.kernels import reference
from conveyor.testing.tiny_models import build_tiny_model

from ._helpers import DEVICE

PROMPTS = [[5 + (7 * i) % 200 for i in range(23)], [9, 41, 3, 77, 120, 6, 18]]
NUM_LAYERS = 2


def _llm(path) -> LLM:
    backend = "triton" if DEVICE == "cuda" else "torch"
    # Eager: a captured CUDA graph would replay the ops it was captured with, whatever the
    # layers are switched to afterwards, and would not call (and count) them either.
    return LLM(str(path), device=DEVICE, dtype="float32", attention_backend=backend, max_num_seqs=2, enforce_eager=True)


def test_kernel_ops_picks_the_triton_kernels_only_on_cuda_with_the_triton_backend():
    from conveyor.kernels import fused_ops

    assert kernel_ops(torch.device("cuda"), "triton") is fused_ops
    assert kernel_ops(torch.device("cuda", 1), "triton") is fused_ops
    assert kernel_ops(torch.device("cuda"), "torch") is reference
    assert kernel_ops(torch.device("cpu"), "triton") is reference
    assert kernel_ops(torch.device("cpu"), "torch") is reference


def test_a_model_on_the_cuda_path_runs_the_fused_ops_and_matches_the_references(tmp_path, monkeypatch):
    from conveyor.kernels import fused_ops

    path = build_tiny_model(tmp_path / "llama", "llama", num_layers=NUM_LAYERS)
    fused, ref = _llm(path), _llm(path)
    model = fused.engine.runner.model
    if DEVICE == "cuda":  # the engine chose them itself
        assert all(m.ops is fused_ops for m in model.modules() if isinstance(m, (RMSNorm, MLP)))
    else:
        use_kernel_ops(model, kernel_ops(torch.device("cuda"), "triton"))
    use_kernel_ops(ref.engine.runner.model, reference)

    calls: Counter[str] = Counter()
    rms_norm, silu_and_mul = fused_ops.rms_norm, fused_ops.silu_and_mul

    def counting_rms_norm(x, weight, eps, residual=None):
        calls["rms_norm with residual" if residual is not None else "rms_norm"] += 1
        return rms_norm(x, weight, eps, residual)

    def counting_silu_and_mul(x):
        calls["silu_and_mul"] += 1
        return silu_and_mul(x)

    monkeypatch.setattr(fused_ops, "rms_norm", counting_rms_norm)
    monkeypatch.setattr(fused_ops, "silu_and_mul", counting_silu_and_mul)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    got = fused.generate(PROMPTS, params)
    steps = fused.engine.stats().num_steps
    assert calls["rms_norm with residual"] == NUM_LAYERS * steps  # after every layer's attention
    assert calls["silu_and_mul"] == NUM_LAYERS * steps
    assert calls["rms_norm"] == (NUM_LAYERS + 1) * steps  # before attention, and the final norm
    want = ref.generate(PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None
        got_lp = [next(iter(e.values())) for e in g.prompt_logprobs[1:] if e is not None]
        want_lp = [next(iter(e.values())) for e in w.prompt_logprobs[1:] if e is not None]
        assert len(got_lp) == len(want_lp) == len(PROMPTS[got.index(g)]) - 1
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=1e-4)
        assert g.logprobs is not None and w.logprobs is not None
        got_out = [e[t] for e, t in zip(g.logprobs, g.token_ids, strict=True)]
        want_out = [e[t] for e, t in zip(w.logprobs, w.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(got_out), torch.tensor(want_out), atol=1e-4, rtol=1e-4)
