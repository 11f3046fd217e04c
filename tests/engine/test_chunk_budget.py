"""The online prefill chunk budget (``target_itl_ms``): the controller alone, fed made-up step
durations (deterministic), then the scheduler and the engine holding to its budget."""

from __future__ import annotations

import random
from typing import Any

import pytest

from conveyor.engine import EngineConfig
from conveyor.engine.core.chunk_budget import PrefillChunkController, make_chunk_controller
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.memory.kv_cache import KVCacheManager
from tests.engine.helpers import make_request, record_steps, step_without_model
from tests.engine.reference import assert_greedy_match, greedy

TARGET = 0.010  # seconds


def _controller(**kw) -> PrefillChunkController:
    kw.setdefault("floor", 32)
    kw.setdefault("ceiling", 4096)
    return PrefillChunkController(TARGET, **kw)


def _feed(
    ctl: PrefillChunkController, duration: float, steps: int, had_decodes: bool = True, had_prefill: bool = True
) -> list[int]:
    budgets = []
    for _ in range(steps):
        ctl.observe(duration, had_decodes, had_prefill)
        budgets.append(ctl.budget)
    return budgets


def test_slow_steps_shrink_the_budget_to_the_floor_and_fast_ones_grow_it_back_to_the_ceiling():
    ctl = _controller()
    assert ctl.budget == 4096
    down = _feed(ctl, 2 * TARGET, 400)
    assert down == sorted(down, reverse=True), "shrinking only"
    assert down[-1] == 32 and min(down) == 32
    # Twice too slow halves it each time a window's p90 is decided (the 3rd slowest of 20:
    # after 3 slow steps): 4096 / 2**7 = 32.
    assert down.index(32) == 3 * 7 - 1
    up = _feed(ctl, 0.5 * TARGET, 600)
    assert up == sorted(up), "growing only"
    assert up[-1] == 4096 and max(up) == 4096


def test_the_shrink_follows_how_far_over_the_target_the_p90_is():
    def after_one_window(duration: float) -> int:
        ctl = _controller(min_samples=8)  # the p90 of 8 is the slowest: one slow step decides
        return _feed(ctl, duration, 1)[0]

    assert after_one_window(1.1 * TARGET) == int(4096 * 0.7)  # a little over: at least SHRINK
    assert after_one_window(2.5 * TARGET) == int(4096 * 0.4)  # 2.5 times over: the budget / 2.5
    assert after_one_window(100 * TARGET) == 4096 // 4  # far over: at most MAX_SHRINK


def test_the_shrink_leaves_the_decodes_time_out_of_the_ratio():
    """Decode-only steps of half the target: of a mixed step 1.5 times the target, the
    prefill part is 1.0 and half of it fits, so the budget halves (not / 1.5)."""
    ctl = _controller(min_samples=8)
    _feed(ctl, 0.5 * TARGET, 10, had_prefill=False)
    assert _feed(ctl, 1.5 * TARGET, 1) == [4096 // 2]
    ctl = _controller(min_samples=8)  # decodes alone over the target: as far down as allowed
    _feed(ctl, 2 * TARGET, 10, had_prefill=False)
    assert _feed(ctl, 3 * TARGET, 1) == [4096 // 4]


def test_a_window_shrinks_as_soon_as_its_p90_is_over_and_grows_only_when_whole():
    ctl = _controller(min_samples=10)  # the p90 of 10 is the 2nd slowest
    _feed(ctl, 0.5 * TARGET, 5)
    assert _feed(ctl, 2 * TARGET, 1) == [4096]  # one slow step: the p90 is not decided yet
    assert _feed(ctl, 2 * TARGET, 1) == [2048]  # a second: it is, without the other three
    # The window was forgotten: the next decision waits for ten new steps to grow.
    assert _feed(ctl, 0.5 * TARGET, 9) == [2048] * 9
    assert _feed(ctl, 0.5 * TARGET, 1) == [int(2048 * 1.25)]


def test_the_p90_ignores_one_slow_step_in_ten_but_not_two():
    ctl = _controller(min_samples=10)
    _feed(ctl, 0.9 * TARGET, 9)  # within the band: no change either way
    assert _feed(ctl, 5 * TARGET, 1) == [4096]
    _feed(ctl, 0.9 * TARGET, 8)
    assert _feed(ctl, 5 * TARGET, 2)[-1] == 4096 // 4


def test_only_steps_that_mix_decodes_and_prefill_count():
    """A step without decodes is no inter-token interval; a step without prefill tokens does
    not depend on the budget. Neither moves it: a budget that had to shrink for a burst of
    prompts stays small through the decode-only stretch that follows."""
    ctl = _controller()
    assert _feed(ctl, 100 * TARGET, 100, had_decodes=False) == [4096] * 100
    assert _feed(ctl, 100 * TARGET, 100, had_prefill=False) == [4096] * 100
    _feed(ctl, 3 * TARGET, 3)
    shrunk = ctl.budget
    assert shrunk < 4096
    assert _feed(ctl, 0.1 * TARGET, 500, had_prefill=False) == [shrunk] * 500


def test_bad_controller_settings_raise():
    with pytest.raises(ValueError, match="floor"):
        PrefillChunkController(TARGET, floor=64, ceiling=32)
    with pytest.raises(ValueError, match="positive number of seconds"):
        PrefillChunkController(0.0, floor=1, ceiling=2)
    with pytest.raises(ValueError, match="min_samples"):
        PrefillChunkController(TARGET, floor=1, ceiling=2, min_samples=0)
    bad_targets: list[Any] = [0, -5.0, float("nan"), "10", True]
    for bad in bad_targets:
        with pytest.raises(ValueError, match="target_itl_ms"):
            EngineConfig("m", target_itl_ms=bad)
    assert make_chunk_controller(None, 16, 8192) is None
    ctl = make_chunk_controller(25, 16, 8192)
    assert ctl is not None and (ctl.target_s, ctl.floor, ctl.ceiling) == (0.025, 32, 8192)
    ctl = make_chunk_controller(25, 16, 20)
    assert ctl is not None and ctl.floor == ctl.ceiling == 20


# ---- the scheduler and the engine hold to the budget --------------------------------------


def test_the_scheduler_limits_prefill_tokens_but_never_decodes():
    ctl = _controller(floor=8, ceiling=256)
    ctl.budget = 10
    sched = Scheduler(KVCacheManager(256, 4), max_num_seqs=16, max_num_batched_tokens=256, chunk_controller=ctl)
    decoding = [make_request(i, 4, 50) for i in range(5)]
    for r in decoding:
        sched.add_request(r)
    # Admit the five short prompts (20 prompt tokens: two steps under a budget of 10).
    for _ in range(3):
        step_without_model(sched)
    assert all(r.output_token_ids for r in decoding)
    sched.add_request(make_request(9, 100, 1))
    sched.add_request(make_request(10, 30, 1))
    for _ in range(6):
        out, _ = step_without_model(sched)
        plan = dict(zip((r.request_id for r in out.requests), out.num_new_tokens, strict=True))
        assert all(plan[r.request_id] == 1 for r in decoding)  # every decode, every step
        assert sum(plan.values()) - len(decoding) == 10  # and exactly the prefill budget
    assert "r10" not in {r.request_id for r in sched.running}  # r9's prefill goes first


# Long prompts (token ids), two running at a time: the later ones are prefilled in chunks
# while the earlier ones decode (steps that mix the two: what the budget is measured on), by
# which time the budget has shrunk.
PROMPT_LENGTHS = [90, 70, 90, 80, 90, 70]
MAX_TOKENS = [30, 30, 10, 10, 10, 10]


def test_the_engine_shrinks_the_prefill_budget_under_an_unmeetable_target(
    tiny_models, hf_reference, make_llm, monkeypatch
):
    """A target no step can meet: the budget falls from the ceiling (max_num_batched_tokens)
    to the floor, each step's prefill tokens stay within the budget in force when it was
    scheduled, and the outputs are still transformers'."""
    path = tiny_models("llama")
    hf = hf_reference(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]
    llm = make_llm(path, block_size=4, max_num_batched_tokens=64, max_num_seqs=2, target_itl_ms=1e-6)
    ctl = llm.engine.scheduler.chunk_controller
    assert ctl is not None and (ctl.floor, ctl.ceiling) == (32, 64)
    budgets: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def schedule_recording_budget():
        budgets.append(ctl.budget)
        return schedule()

    monkeypatch.setattr(llm.engine.scheduler, "schedule", schedule_recording_budget)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    for i, (ids, m, out) in enumerate(zip(prompts, MAX_TOKENS, outs, strict=True)):
        assert_greedy_match(out.token_ids, hf.greedy(ids, m), label=f"prompt {i}")
    assert ctl.budget == 32 and ctl.num_shrinks >= 1
    prefill = [sum(n for c, n, t in s if not (n == 1 and c + 1 == t)) for s in steps]
    assert all(p <= b for p, b in zip(prefill, budgets, strict=True))
    assert 64 in prefill, "before the first decision the whole budget is used"
    assert any(p == 32 for p, b in zip(prefill, budgets, strict=True) if b == 32), "the floor limited a step"
