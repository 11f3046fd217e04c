"""Qwen3.5's CUDA path runs the gated delta rule's Triton kernels (``GatedDeltaNet.delta``, set by
``use_kernel_ops`` where ``kernel_ops`` picks the Triton ops) and gives transformers' greedy
tokens: with chunked prefill under a small token budget (the state carried across chunks,
chunks mixed with decodes in one step) and prompts of one token, and with ngram speculative
decoding (the prefill kernel's snapshots, rolled back to on a rejection).

Without a GPU the CUDA path's choice is applied to a CPU engine and its kernels run in Triton's
interpreter; with one (``CONVEYOR_TEST_GPU=1``) the engine on CUDA must have chosen them itself."""

from __future__ import annotations

from collections import Counter

import torch

from conveyor.engine import LLM
from conveyor.engine.models.layers import kernel_ops, use_kernel_ops
from conveyor.engine.models.qwen3_5 import GatedDeltaNet
from conveyor.kernels import gated_delta
from tests.engine.helpers import spy
from tests.engine.reference import HFReference, assert_outputs_match, greedy

from ._helpers import DEVICE

PROMPTS = [
    "The chef will bring",
    "Seven guests wait at the table and the waiter pours cold water while the kitchen",
    "A",
    "Count to ten: one two three four five six seven eight nine ten, then eleven twelve",
]
MAX_TOKENS = [9, 6, 12, 5]


def _on_the_cuda_path(llm: LLM, monkeypatch) -> Counter[str]:
    """Switch a CPU engine's model to the Triton kernels (on CUDA: check it chose them); the
    kernels' calls, counted."""
    from conveyor.kernels import gated_delta_triton

    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert (layers and all(m.delta is gated_delta for m in layers)) or DEVICE == "cuda"
    if DEVICE != "cuda":
        use_kernel_ops(model, kernel_ops(torch.device("cuda"), "triton"))
    assert all(m.delta is gated_delta_triton for m in layers)

    calls: Counter[str] = Counter()
    for name in ("gated_delta_decode", "gated_delta_prefill", "causal_conv1d_update"):
        kernel = getattr(gated_delta_triton, name)

        def counting(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(gated_delta_triton, name, counting)
    return calls


def _engine(path: str, **kwargs) -> LLM:
    backend = "triton" if DEVICE == "cuda" else "torch"
    return LLM(path, device=DEVICE, dtype="float32", attention_backend=backend, enforce_eager=True, **kwargs)


def test_qwen3_5_on_the_cuda_path_runs_the_triton_delta_rule_and_matches_transformers(tiny_models, monkeypatch):
    path = tiny_models("qwen3_5", num_layers=4)  # three linear-attention layers, then full attention
    llm = _engine(path, max_num_seqs=4, max_num_batched_tokens=8)
    calls = _on_the_cuda_path(llm, monkeypatch)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(HFReference(path), PROMPTS, MAX_TOKENS, outs)
    assert calls["gated_delta_prefill"] and calls["gated_delta_decode"] and calls["causal_conv1d_update"], calls
    state = llm.engine.runner.state_cache
    assert state is not None and bool((state.slot_of_block == -1).all())  # every slot released


def test_speculative_decoding_on_the_cuda_path_rolls_the_state_back(tiny_models, monkeypatch):
    """ngram speculation with the Triton kernels: verifications leave their snapshots from the
    prefill kernel, and rejections roll the state back to them (small weights: the tiny model
    loops, with breaks)."""
    path = tiny_models("qwen3_5", num_layers=4, init_std=0.005)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = _engine(path, max_num_seqs=4, speculative_config=ngram)
    calls = _on_the_cuda_path(llm, monkeypatch)
    state = llm.engine.runner.state_cache
    assert state is not None
    rollbacks = spy(monkeypatch, state, "rollback")
    prompts = [
        "A guest asks for the menu and the bill; the waiter brings the menu, then the bill, then",
        "one two three one two three one two three one two",
        "The chef will bring the soup to the table",
    ]
    max_tokens = [20, 18, 16]  # (the interpreter runs every kernel: few tokens, rejections and acceptances still)
    outs = llm.generate(prompts, greedy(max_tokens, ignore_eos=True))
    assert_outputs_match(HFReference(path), prompts, max_tokens, outs)
    stats = llm.engine.stats().spec_decode
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_proposed_tokens, stats
    assert rollbacks and calls["gated_delta_prefill"], calls
    assert bool((state.slot_of_block == -1).all())
