"""Builders and checks the engine tests share (fixtures stay in conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.scheduler_output import SchedulerOutput
from conveyor.engine.core.step_result import StepResult
from conveyor.engine.sampling_params import SamplingParams

# Phi-3 with LongRoPE: 8 factors (head_dim 16), far from 1, so a wrong set changes the output;
# max_position_embeddings 512 over 128 makes the factor 4 (attention factor ~1.13).
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.3 * i for i in range(8)],
    "long_factor": [2.0 + 1.5 * i for i in range(8)],
    "original_max_position_embeddings": 128,
}
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.5,  # (DeepSeek-V3 ships 1.0 and 1.0: an attention factor of 1)
    "mscale_all_dim": 1.0,
}
# A model name the correctness tests take -> (family, build_tiny_model's kwargs, the engine's
# kwargs). Other names are a family with its defaults. ``phi3-longrope`` keeps the engine
# inside the original context (max_model_len 128), where transformers uses the short factors.
MODEL_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "phi3-longrope": ("phi3", {"rope_scaling": PHI3_LONGROPE, "max_position_embeddings": 512}, {"max_model_len": 128}),
    # Qwen2-MoE with dense layers among the sparse ones: of four layers, decoder_sparse_step 2
    # makes 1 and 3 sparse and mlp_only_layers turns 3 dense again (layers 0, 2, 3 dense).
    # Mistral with a window shorter than most prompts: every layer slides, and max_model_len
    # is no longer capped at the window.
    "mistral-window": ("mistral", {"sliding_window": 8}, {}),
    # Gemma ties its embeddings in every real checkpoint (the tiny default is untied: tied, the
    # scaled embedding dominates and a random model repeats its last token).
    "gemma3-tied": ("gemma3", {"tie_word_embeddings": True}, {}),
    # Gemma 4's MoE block (26B-A4B's layout) beside every layer's MLP, over the default's shared KV
    # and per-layer inputs.
    "gemma4-moe": (
        "gemma4",
        {"moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}},
        {},
    ),
    # DeepSeek-V3 at a smaller init for bf16: at 0.5 its grouped routing sits on knife edges, where
    # bf16 rounding (transformers' own too) picks another expert and moves logits by ~10.
    "deepseek_v3-bf16": ("deepseek_v3", {"init_std": 0.2}, {}),
    # DeepSeek-V3's YaRN (factor 4 over an original context of 32: the ramp, the attention factor
    # on cos/sin and mscale's square on the softmax scale all apply), queries without the
    # low-rank bottleneck (q_lora_rank None: one q_proj, as DeepSeek-V2-Lite), rope not interleaved.
    "deepseek_v3-yarn": (
        "deepseek_v3",
        {
            "rope_scaling": DEEPSEEK_YARN,
            "max_position_embeddings": 128,
            "mla": {"q_lora_rank": None, "rope_interleave": False},
        },
        {},
    ),
    # The hybrid families at four layers: three linear-attention layers, then a full one.
    "qwen3_5": ("qwen3_5", {"num_layers": 4}, {}),
    "qwen3_5_moe": ("qwen3_5_moe", {"num_layers": 4}, {}),
    "qwen3_next": ("qwen3_next", {"num_layers": 4}, {}),
    "qwen2_moe-dense-layers": (
        "qwen2_moe",
        {"num_layers": 4, "moe": {"decoder_sparse_step": 2, "mlp_only_layers": [3]}},
        {},
    ),
}


def model_case(tiny_models, name: str) -> tuple[str, dict[str, Any]]:
    """The checkpoint of ``name`` (a ``MODEL_CASES`` key or a family) and the engine kwargs it needs."""
    family, build, engine = MODEL_CASES.get(name, (name, {}, {}))
    return tiny_models(family, **build), dict(engine)


def assert_no_leaks(engine) -> None:
    assert not engine.has_unfinished_requests()
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked"
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv._blocks and not engine._groups
    assert sorted(kv.pool.free_queue.block_ids()) == list(range(kv.num_blocks))
    state = getattr(kv, "state", None)  # a hybrid model's state slots (``conveyor.engine.memory.state_memory``)
    if state is not None:
        assert kv.num_free_state_slots == state.num_slots, "state slots leaked"
        assert bool((state.slot_of_block == -1).all()), "a KV block still names a state slot"


def spy(monkeypatch, obj: object, name: str) -> list[tuple[tuple[Any, ...], Any]]:
    """Wrap ``obj.name`` so that each call's (positional arguments, result) is recorded."""
    calls: list[tuple[tuple[Any, ...], Any]] = []
    original = getattr(obj, name)

    def recording(*args: Any) -> Any:
        result = original(*args)
        calls.append((args, result))
        return result

    monkeypatch.setattr(obj, name, recording)
    return calls


def record_steps(monkeypatch, scheduler) -> list[list[tuple[int, int, int]]]:
    """Record every step ``scheduler`` plans: per scheduled request, (tokens computed before,
    new tokens, tokens in all)."""
    steps: list[list[tuple[int, int, int]]] = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append(
            [(r.num_computed_tokens, n, r.num_tokens) for r, n in zip(out.requests, out.num_new_tokens, strict=True)]
        )
        return out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    return steps


def assert_chunked_prefill_steps(steps: list[list[tuple[int, int, int]]], budget: int) -> None:
    """Every step kept to the token budget, and some step mixed a prefill chunk with decodes."""
    assert all(sum(n for _, n, _ in s) <= budget for s in steps), "token budget exceeded"
    mixed = [s for s in steps if any(n == 1 and c + 1 == t for c, n, t in s) and any(n > 1 for _, n, _ in s)]
    assert mixed, "no step mixed a prefill chunk with decodes"


def make_request(
    seq: int, num_prompt: int = 0, max_tokens: int = 1, *, tokens: list[int] | None = None, **kw: Any
) -> Request:
    """A scheduler-level request ``r<seq>`` arriving ``seq``-th: ``tokens``, or ``num_prompt`` prompt
    tokens no other request shares; EOS ignored, so it runs its ``max_tokens``."""
    ids = tokens if tokens is not None else [1000 * (seq + 1) + i for i in range(num_prompt)]
    return Request(
        f"r{seq}",
        ids,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_total_tokens=100_000,
        eos_token_ids=frozenset(),
        arrival_seq=seq,
        **kw,
    )


def step_without_model(
    sched: Scheduler, token_of: Callable[[Request], int] = lambda req: 7
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with the model left out: schedule, and every request whose scheduled
    chunk reaches its last token produces ``token_of(req)``; the scheduler's own update does
    the rest. Returns the step's plan and the requests it finished."""
    out = sched.schedule()
    sampled = [
        req
        for req, n in zip(out.requests, out.num_new_tokens, strict=True)
        if req.num_computed_tokens + n >= req.num_tokens
    ]
    result = StepResult(sampled, [token_of(req) for req in sampled])
    return out, sched.update_from_output(out, result)
