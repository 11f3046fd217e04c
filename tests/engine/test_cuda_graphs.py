"""CUDA graphs for decode batches.

On CPU there is no CUDA graph, but everything around it is ours and runs here: the buckets,
the static buffers, the padding rows, the pinned split count, the choice between graph and
eager per step. ``CallingGraph`` stands in for ``torch.cuda.CUDAGraph``: it runs the captured
forward at capture (as the real capture does) and calls it again on each replay, over the
same static buffers, through the Triton kernels in the interpreter. On a GPU
(``CONVEYOR_TEST_GPU=1``) the last tests capture real graphs.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conveyor.engine import RequestOutput, SamplingParams
from conveyor.engine.runner.cuda_graphs import CallingGraph, graph_batch_sizes
from conveyor.kernels.interpreter import kernel_device
from tests.engine.helpers import spy
from tests.engine.reference import assert_outputs_match, greedy
from tests.engine.test_triton_backend import PROMPTS, needs_triton

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"

MAX_TOKENS = [9, 4, 12, 6, 10, 1]  # after the prefill: 5, 4, 3, 2, then 1 decodes a step


@pytest.fixture
def model(tiny_models):
    return tiny_models("llama")


def _graph_llm(make_llm, model, **kwargs):
    """An engine replaying decode graphs: real CUDA graphs on a GPU, ``CallingGraph`` on CPU."""
    llm = make_llm(model, attention_backend="triton", device=DEVICE, **kwargs)
    runner = llm.engine.runner
    assert (runner.graphs is not None) == ON_GPU  # captured by itself on a GPU only
    runner.kv_cache.fill_(float("nan"))  # every read must be of a slot written before
    runner.capture_decode_graphs(graph_factory=None if ON_GPU else CallingGraph)
    # Warm-up and capture run the forward on padding rows only: they wrote nothing.
    assert runner.kv_cache.isnan().all()
    return llm


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b % 8 == 0 for b in sizes[3:])


@needs_triton
def test_decode_graphs_match_transformers(model, hf_reference, make_llm, monkeypatch):
    llm = _graph_llm(make_llm, model, max_num_seqs=8)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8] and set(graphs.graphs) == {1, 2, 4, 8}
    runs = spy(monkeypatch, graphs, "run")

    hf = hf_reference(model)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf, PROMPTS, MAX_TOKENS, outs)
    # Every step after the prefill decodes only, and replayed the smallest bucket that
    # holds it, padded where the batch is smaller: (bucket, decodes).
    steps = [(bucket, len(input_ids)) for (bucket, input_ids, *_), _ in runs]
    assert sorted(set(steps), reverse=True) == [(8, 5), (4, 4), (4, 3), (2, 2), (1, 1)]
    assert len(steps) == max(MAX_TOKENS) - 1 == sum(graphs.replays.values())


@needs_triton
def test_graph_and_eager_steps_interleave(model, hf_reference, make_llm, monkeypatch):
    """Requests arriving while others decode: prefill steps run eagerly, decode-only steps
    replay graphs; a batch above the largest bucket runs eagerly; outputs stay exact."""
    llm = _graph_llm(make_llm, model, max_num_seqs=8, cuda_graph_max_batch_size=4)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 2, 4]
    engine, runner = llm.engine, llm.engine.runner
    max_tokens = [14, 10, 12, 8, 6, 9]
    params = greedy(max_tokens)
    eager_calls = spy(monkeypatch, runner, "forward_eager")
    arrivals = {3: 2, 6: 3, 7: 4, 9: 5}  # step -> request index: joins mid-flight
    for i in range(2):
        engine.add_request(f"r{i}", PROMPTS[i], params[i])
    outputs: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in arrivals:
            engine.add_request(f"r{arrivals[step]}", PROMPTS[arrivals[step]], params[arrivals[step]])
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    hf = hf_reference(model)
    outs = [outputs[f"r{i}"] for i in range(len(PROMPTS))]
    assert_outputs_match(hf, PROMPTS, max_tokens, outs)
    assert graphs.replays[4] > 0 and graphs.replays[2] > 0 and graphs.replays[1] > 0
    # (decodes, tokens) of eager steps: prefills mixed with decodes, and decode-only
    # batches above the largest bucket.
    eager_steps = [(args[-1], len(args[0])) for args, _ in eager_calls]
    assert any(d < t and d > 0 for d, t in eager_steps)
    assert any(d == t > 4 for d, t in eager_steps)


@needs_triton
def test_seeded_sampling_is_the_same_with_graphs(model, make_llm):
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=s) for s in range(4)]
    eager = make_llm(model, attention_backend="triton", device=DEVICE, enforce_eager=True).generate(PROMPTS[:4], params)
    llm = _graph_llm(make_llm, model, max_num_seqs=4)
    graphed = llm.generate(PROMPTS[:4], params)
    assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


class _HostSyncs(TorchDispatchMode):
    """Records operators that cannot be captured in a CUDA graph: reading a device value on
    the host (``.item()``, ``.tolist()``, data-dependent shapes) or baking a host value into
    a new tensor (``torch.tensor(...)``), which a replay would never see change."""

    FORBIDDEN = (
        "aten.item",
        "aten._local_scalar_dense",
        "aten.lift_fresh",
        "aten.nonzero",
        "aten.masked_select",
        "aten.unique",
        "aten._unique2",
        "aten.repeat_interleave.Tensor",
    )

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.FORBIDDEN):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@needs_triton
def test_the_captured_forward_never_syncs_with_the_host(model, make_llm):
    llm = _graph_llm(make_llm, model, max_num_seqs=4)
    graphs = llm.engine.runner.graphs
    llm.generate(PROMPTS[:1], greedy([2]))  # some real context in the cache
    mode = _HostSyncs()
    with mode:  # the interpreter's launches touch tensors without dispatch: still meaningful
        graphs._forward_fn(4)()  # the captured function, run again outside the graph
    assert mode.seen == []
    # ...and the check sees a sync when there is one.
    with mode:
        int(torch.ones(2).sum())
    assert mode.seen == ["aten._local_scalar_dense.default"]


@needs_triton
def test_hybrid_decode_graphs_match_transformers(tiny_models, hf_reference, make_llm, monkeypatch):
    """Qwen3.5's decode steps replay graphs: each row's state slot and fresh flag are read on
    the device, and padding rows (stale block tables) use the padding slot, never a request's."""
    model = tiny_models("qwen3_5", num_layers=4)
    llm = _graph_llm(make_llm, model, max_num_seqs=8)
    runner = llm.engine.runner
    state, graphs = runner.state_cache, runner.graphs
    assert state is not None and set(graphs.graphs) == {1, 2, 4, 8}
    # Warm-up and capture ran padding rows only: no request's slot was written.
    assert all(bool((t[: state.num_slots] == 0).all()) for t in (*state.conv, *state.recurrent))
    runs = spy(monkeypatch, graphs, "run")
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(model), PROMPTS, MAX_TOKENS, outs)
    steps = {(bucket, len(input_ids)) for (bucket, input_ids, *_), _ in runs}
    assert (8, 5) in steps and (4, 3) in steps  # padded buckets replayed
    assert bool((state.slot_of_block == -1).all())  # every slot released
    llm.generate(PROMPTS[:1], greedy([2]))
    mode = _HostSyncs()
    with mode:
        graphs._forward_fn(4)()
    assert mode.seen == []


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (CONVEYOR_TEST_GPU=1)")
def test_real_cuda_graphs_match_transformers(model, hf_reference, make_llm):
    llm = make_llm(model, device="cuda", dtype="float32", max_num_seqs=8)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and set(graphs.graphs) == {1, 2, 4, 8}
    hf = hf_reference(model)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf, PROMPTS, MAX_TOKENS, outs)
    assert sum(graphs.replays.values()) > 0
    eager = make_llm(model, device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert [o.token_ids for o in eager.generate(PROMPTS, greedy(MAX_TOKENS))] == [o.token_ids for o in outs]
