"""MoE models on the fused Triton kernel (forced on CPU, in Triton's interpreter; compiled on
a GPU), gpt-oss's included: greedy tokens identical to transformers, CUDA graphs allowed only when every block
uses it, and its decode graphs free of host syncs."""

from __future__ import annotations

import pytest

from conveyor.engine.models.gpt_oss import GptOssExperts
from conveyor.engine.models.moe import SparseMoE
from conveyor.engine.runner.cuda_graphs import CallingGraph
from conveyor.kernels.interpreter import kernel_device
from tests.engine.reference import assert_outputs_match, greedy
from tests.engine.test_cuda_graphs import _HostSyncs
from tests.engine.test_triton_backend import needs_triton

pytest.importorskip("triton")

PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours", "A"]
MAX_TOKENS = [9, 5, 12]
DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"


def test_kernel_path_matches_transformers(tiny_models, hf_reference, make_llm, monkeypatch):
    """Mixtral, eager (Qwen2-MoE with its shared expert runs on the kernel in the graph test below)."""
    monkeypatch.setattr(SparseMoE, "use_fused_kernel", True)
    path = tiny_models("mixtral")
    llm = make_llm(path, device=DEVICE, enforce_eager=True)
    model = llm.engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.fused for b in blocks)
    assert model.supports_cuda_graphs
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_torch_path_on_cpu_is_not_captured(family, tiny_models, make_llm):
    model = make_llm(tiny_models(family)).engine.runner.model
    assert not any(m.fused for m in model.modules() if isinstance(m, SparseMoE | GptOssExperts))
    assert not model.supports_cuda_graphs


@needs_triton
@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_decode_graphs_on_the_kernel_path_match_transformers_and_never_sync(
    family, tiny_models, hf_reference, make_llm, monkeypatch
):
    """The decode graphs of an MoE model on the kernel (``CallingGraph`` standing in for the
    CUDA graph, as in test_cuda_graphs): transformers' tokens, and the captured forward reads
    nothing back to the host. gpt-oss's experts run the kernel's clamped SwiGLU with biases."""
    monkeypatch.setattr(SparseMoE, "use_fused_kernel", True)
    path = tiny_models(family)
    llm = make_llm(path, attention_backend="triton", device=DEVICE, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.model.supports_cuda_graphs
    runner.capture_decode_graphs(graph_factory=None if ON_GPU else CallingGraph)
    graphs = runner.graphs
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)
    assert sum(graphs.replays.values()) > 0
    mode = _HostSyncs()
    with mode:
        graphs._forward_fn(4)()  # the captured function, run again outside the graph
    assert mode.seen == []
