"""The LLMEngine / LLM contract: bad input, abort, caps, policies, metrics and stats."""

from __future__ import annotations

import pytest

from conveyor.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.memory.kv_cache import KVCacheManager
from tests.engine.helpers import assert_no_leaks

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_models):
    e = LLMEngine(EngineConfig(tiny_models("llama"), device="cpu", max_model_len=64))
    yield e
    assert_no_leaks(e)


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("", "prompt is empty"),
        ([], "prompt_token_ids is empty"),
        ([1, 2, 10**6], "not in the vocabulary"),
        ([1, "2"], "not in the vocabulary"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"content": "hi"}]}, "role"),
        ({"prompt": "a", "messages": []}, "exactly one of"),
        (3.5, "prompt must be"),
        (list(range(3, 70)), "prompt is 67 tokens; this engine takes at most 63"),
    ],
)
def test_bad_input_raises_a_clear_error_and_changes_nothing(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, GREEDY)
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("a", "Tea", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "Tea", GREEDY)
    _drain(engine)
    engine.add_request("a", "Tea", GREEDY)  # reusable once finished
    _drain(engine)


def test_one_bad_prompt_does_not_sink_the_batch(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"), max_model_len=64)
    outs = llm.generate(["Tea", list(range(3, 100)), "The chef"], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "prompt is 97 tokens" in outs[1].error
    assert len(outs[0].token_ids) == len(outs[2].token_ids) == 8


def test_abort_mid_flight_frees_blocks_and_reports(engine):
    for rid in ("a", "b", "c"):
        engine.add_request(rid, "Seven guests wait at the table", SamplingParams(max_tokens=30, temperature=0))
    engine.step()
    engine.step()
    engine.abort_request("b")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["b"].finished and outs["b"].finish_reason == "abort"
    assert 0 < len(outs["b"].token_ids) < 30
    done = _drain(engine)
    assert set(done) == {"a", "c"}
    engine.abort_request("unknown")  # aborting an unknown or finished id is a no-op


def test_abort_of_a_waiting_request(tiny_models):
    engine = LLMEngine(EngineConfig(tiny_models("llama"), device="cpu", max_num_seqs=1))
    engine.add_request("a", "Tea", GREEDY)
    engine.add_request("b", "Tea", GREEDY)
    engine.step()
    engine.abort_request("b")
    done = _drain(engine)
    assert done["b"].finish_reason == "abort" and done["b"].token_ids == []
    assert done["a"].finish_reason == "length"
    assert_no_leaks(engine)


def test_sequence_cap_and_token_budget_hold_every_step(tiny_models):
    engine = LLMEngine(EngineConfig(tiny_models("llama"), device="cpu", max_num_seqs=3, max_num_batched_tokens=10))
    for i in range(7):
        engine.add_request(f"r{i}", "Late guests ask the waiter about the menu " * (i % 3 + 1), GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.stats()
        assert s.num_running <= 3 and s.last_step_tokens <= 10
    assert_no_leaks(engine)


def test_priority_policy_admits_the_most_important_first(tiny_models):
    engine = LLMEngine(EngineConfig(tiny_models("llama"), device="cpu", max_num_seqs=1, scheduling_policy="priority"))
    engine.add_request("low", "Tea", GREEDY, priority=5)
    engine.add_request("high", "Tea", GREEDY, priority=0)
    engine.add_request("mid", "Tea", GREEDY, priority=2)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]
    assert_no_leaks(engine)


def test_edf_policy_admits_the_earliest_deadline_first(tiny_models):
    engine = LLMEngine(EngineConfig(tiny_models("llama"), device="cpu", max_num_seqs=1, scheduling_policy="edf"))
    engine.add_request("none", "Tea", GREEDY)
    engine.add_request("late", "Tea", GREEDY, deadline=2_000_000_000)
    engine.add_request("soon", "Tea", GREEDY, deadline=1_700_000_000.5)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["soon", "late", "none"]
    assert_no_leaks(engine)


@pytest.mark.parametrize("bad", ["soon", True, float("nan"), float("inf")])
def test_add_request_rejects_a_bad_deadline(engine, bad):
    with pytest.raises(ValueError, match="deadline must be a finite number of epoch seconds"):
        engine.add_request("a", "Tea", GREEDY, deadline=bad)


def test_priority_policy_preempts_the_least_important(tiny_models):
    engine = LLMEngine(
        EngineConfig(tiny_models("llama"), device="cpu", block_size=4, num_kv_blocks=12, scheduling_policy="priority")
    )
    engine.add_request(
        "low", "Tea and bread", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), priority=9
    )
    engine.add_request(
        "high", "Tea and cake", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), priority=1
    )
    done = _drain(engine)
    assert done["low"].metrics.num_preemptions > 0 and done["high"].metrics.num_preemptions == 0
    assert_no_leaks(engine)


def test_metrics_and_stats(engine):
    engine.add_request(
        "a", "Seven guests wait at the table", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    engine.add_request("b", "Tea", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    done = _drain(engine)
    m = done["a"].metrics
    assert m.first_scheduled_time is not None and m.first_token_time is not None and m.finished_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_prompt_tokens == len(done["a"].prompt_token_ids) and m.num_generated_tokens == 6
    ttft, tpot, e2e = m.time_to_first_token, m.time_per_output_token, m.e2e_latency
    assert ttft is not None and tpot is not None and e2e is not None
    assert ttft > 0 and tpot > 0 and e2e >= ttft
    s = engine.stats()
    assert s.num_generated_tokens == 9 and s.num_running == s.num_waiting == 0
    assert s.kv_blocks_used == 0 and s.kv_blocks_free == s.kv_blocks_total and s.kv_usage == 0.0
    assert s.num_steps >= 6 and s.avg_tokens_per_step > 0
    assert s.num_prompt_tokens_computed == sum(len(o.prompt_token_ids) for o in done.values())


def test_token_id_prompts_and_progress_bar(tiny_models, make_llm, capsys):
    llm = make_llm(tiny_models("llama"))
    ids = llm.get_tokenizer().encode("The chef will bring")
    by_text, by_ids = llm.generate(["The chef will bring", ids], GREEDY, use_tqdm=True)
    assert by_text.token_ids == by_ids.token_ids and by_ids.prompt_token_ids == ids
    assert "generate" in capsys.readouterr().err


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig("m", block_size=3)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig("m", scheduling_policy="random")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig("m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"not a directory|could not find model"):
        LLMEngine(EngineConfig("./no/such/model"))


def test_scheduler_rejects_an_unknown_policy():
    """Built directly (no EngineConfig to check first), an unknown policy is an error naming
    it and the valid ones, not a silent FCFS."""
    with pytest.raises(ValueError, match=r"'lifo'.*'fcfs', 'priority', 'prefix'"):
        Scheduler(KVCacheManager(8, 4), max_num_seqs=2, max_num_batched_tokens=16, policy="lifo")


def test_final_only_requests_report_once_with_the_streamed_text(engine):
    prompt = "Seven guests wait at the table"
    engine.add_request("streamed", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.add_request("final", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stream=False))
    seen: dict[str, list[RequestOutput]] = {"streamed": [], "final": []}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o)
    assert len(seen["final"]) == 1 and len(seen["streamed"]) == 12
    final, last = seen["final"][0], seen["streamed"][-1]
    assert final.finished and final.token_ids == last.token_ids and final.new_token_ids == last.token_ids
    assert final.text == last.text == "".join(o.new_text for o in seen["streamed"]) == final.new_text
    with pytest.raises(ValueError, match="stream"):
        SamplingParams(stream="yes")  # type: ignore[arg-type]  # the wrong type on purpose


def test_a_request_failing_mid_step_does_not_sink_the_batch(engine):
    for rid in ("a", "b", "c"):
        engine.add_request(
            rid, "Seven guests wait at the table", SamplingParams(max_tokens=10, temperature=0, stop="zzz")
        )

    class Broken:
        text = ""

        def add(self, token_id):
            raise RuntimeError("detokenizer broke")

        def take_delta(self, finished):
            return ""

    engine._groups["b"][0].detokenizer = Broken()
    done = _drain(engine)
    assert done["b"].finish_reason == "error" and "RuntimeError: detokenizer broke" in str(done["b"].error)
    assert done["a"].finish_reason == done["c"].finish_reason == "length"
    assert len(done["a"].token_ids) == 10
    engine.add_request("b", "Tea", GREEDY)  # the failed id is free again
    _drain(engine)


def test_without_chunked_prefill_requests_are_bounded_by_the_step_budget(tiny_models):
    engine = LLMEngine(
        EngineConfig(
            tiny_models("llama"),
            device="cpu",
            enable_chunked_prefill=False,
            max_num_batched_tokens=32,
            block_size=4,
            num_kv_blocks=12,
        )
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens without chunked prefill"):
        engine.add_request("long", list(range(3, 40)), GREEDY)
    for i in range(3):  # 3 x 32 tokens > 48 cache slots: preempted requests must be re-admittable
        engine.add_request(f"r{i}", list(range(3, 23)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    done = _drain(engine)
    assert all(o.finish_reason == "length" and len(o.prompt_token_ids) + len(o.token_ids) == 32 for o in done.values())
    assert engine.stats().num_preemptions > 0
    assert_no_leaks(engine)
