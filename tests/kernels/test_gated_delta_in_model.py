"""Qwen3.5's CUDA path runs the gated delta rule's Triton kernels (``GatedDeltaNet.delta``, set by
``use_kernel_ops`` where ``kernel_ops`` picks the Triton ops) and gives transformers' greedy
tokens: with chunked prefill under a small token budget (the state carried across chunks,
chunks mixed with decodes in one step) and prompts of one token.

Without a GPU the CUDA path's choice is applied to a CPU engine and its kernels run in Triton's
interpreter; with one (``CONVEYOR_TEST_GPU=1``) the engine on CUDA must have chosen them itself."""

from __future__ import annotations

from collections import Counter

import torch

from engine import LLM
from engine.models.llama import kernel_ops, use_kernel_ops
from engine.models.qwen3_5 import GatedDeltaNet
from kernels import gated_delta
from tests.engine.reference import HFReference, assert_outputs_match, greedy

from ._helpers import DEVICE

PROMPTS = [
    "The chef will bring",
    "Seven guests wait at the table and the waiter pours cold water while the kitchen",
    "A",
    "Count to ten: one two three four five six seven eight nine ten, then eleven twelve",
]
MAX_TOKENS = [9, 6, 12, 5]


def test_qwen3_5_on_the_cuda_path_runs_the_triton_delta_rule_and_matches_transformers(tiny_models, monkeypatch):
    from kernels import gated_delta_triton

    path = tiny_models("qwen3_5", num_layers=4)  # three linear-attention layers, then full attention
    backend = "triton" if DEVICE == "cuda" else "torch"
    llm = LLM(path, device=DEVICE, dtype="float32", attention_backend=backend, max_num_seqs=4,
              max_num_batched_tokens=8, enforce_eager=True)  # fmt: skip
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert (layers and all(m.delta is gated_delta for m in layers)) or DEVICE == "cuda"
    if DEVICE != "cuda":
        use_kernel_ops(model, kernel_ops(torch.device("cuda"), "triton"))
    assert all(m.delta is gated_delta_triton for m in layers)

    calls: Counter[str] = Counter()
    for name in ("gated_delta_decode", "gated_delta_prefill", "causal_conv1d_update"):
        kernel = getattr(gated_delta_triton, name)

        def counting(*args, _kernel=kernel, _name=name):
            calls[_name] += 1
            return _kernel(*args)

        monkeypatch.setattr(gated_delta_triton, name, counting)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(HFReference(path), PROMPTS, MAX_TOKENS, outs)
    assert calls["gated_delta_prefill"] and calls["gated_delta_decode"] and calls["causal_conv1d_update"], calls
    state = llm.engine.runner.state_cache
    assert state is not None and bool((state.slot_of_block == -1).all())  # every slot released
