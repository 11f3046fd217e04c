"""The CPU thread tuner: it keeps the faster count on a quiet machine, drops threads beside a busy
neighbour within one probe (at once when one arrives mid-run), a collapsing count costs one slow
step, and it climbs back when the neighbour leaves. The engine runs each step on the count
chosen for it."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.runner.thread_tuner import MAX_PROBE_INTERVAL_S, PROBE_INTERVAL_S, ThreadTuner, thread_ladder


def test_ladder_is_powers_of_two_and_the_budget():
    assert thread_ladder(1) == [1]
    assert thread_ladder(2) == [1, 2]
    assert thread_ladder(6) == [1, 2, 4, 6]
    assert thread_ladder(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="at least 2 threads"):
        ThreadTuner(1)


class Machine:
    """A simulated clock and step cost: seconds per token at each thread count."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.now = 0.0
        self.cost = cost
        self.steps_at: dict[int, int] = {}

    def clock(self) -> float:
        return self.now

    def run(self, tuner: ThreadTuner, steps: int, tokens: int = 32) -> None:
        for _ in range(steps):
            threads = tuner.before_step()
            seconds = self.cost[threads] * tokens
            self.now += seconds
            self.steps_at[threads] = self.steps_at.get(threads, 0) + 1
            tuner.after_step(seconds, tokens)


QUIET = {1: 1.6e-3, 2: 1.0e-3}  # two threads faster, as on an idle machine
BUSY = {1: 1.2e-3, 2: 12e-3}  # one CPU taken by a neighbour: two threads collapse


def test_quiet_machine_keeps_every_thread_and_probes_less_and_less():
    m = Machine(QUIET)
    tuner = ThreadTuner(2, clock=m.clock)
    m.run(tuner, 3000)  # ~96 s of steps
    assert tuner.threads == 2 and tuner.num_changes == 0
    # Probes back off to one every MAX_PROBE_INTERVAL_S: few, and few steps spent on 1 thread.
    assert tuner.num_probes <= 2 + m.now / MAX_PROBE_INTERVAL_S
    assert m.steps_at[1] <= 3 * tuner.num_probes


def test_busy_neighbour_drops_a_thread_in_the_first_probe_and_stays():
    m = Machine(BUSY)
    tuner = ThreadTuner(2, clock=m.clock)
    while m.now < PROBE_INTERVAL_S:
        m.run(tuner, 1)
    m.run(tuner, 6)  # one probe: three pairs
    assert tuner.threads == 1 and tuner.num_changes == 1
    before = m.steps_at[2]
    m.run(tuner, 3000)
    assert tuner.threads == 1
    # Probing 2 threads again gives up after one pair each time: one slow step per probe.
    assert m.steps_at[2] - before == tuner.num_probes - 1


def test_a_neighbour_arriving_is_noticed_at_once_not_at_the_next_probe():
    m = Machine(QUIET)
    tuner = ThreadTuner(2, clock=m.clock)
    m.run(tuner, 3000)  # probes have backed off to one every MAX_PROBE_INTERVAL_S
    assert tuner.threads == 2
    m.cost = BUSY
    arrived = m.steps_at.get(2, 0)
    m.run(tuner, 4)  # one slow step is a surprise; the probe's first pair decides
    assert tuner.threads == 1
    assert m.steps_at[2] - arrived <= 2  # slow steps paid for the change


def test_neighbour_leaving_brings_the_threads_back():
    m = Machine(BUSY)
    tuner = ThreadTuner(2, clock=m.clock)
    m.run(tuner, 3000)
    assert tuner.threads == 1
    m.cost = QUIET
    left_at = m.now
    while tuner.threads == 1:
        m.run(tuner, 1)
        assert m.now - left_at < MAX_PROBE_INTERVAL_S + 1.0, "still on one thread long after the neighbour left"


def test_a_small_difference_is_not_a_reason_to_change():
    m = Machine({1: 1.0e-3, 2: 0.97e-3})  # within the margin: noise on a real machine
    tuner = ThreadTuner(2, clock=m.clock)
    m.run(tuner, 2000)
    assert tuner.threads == 2 and tuner.num_changes == 0


def test_larger_budgets_climb_the_ladder_one_rung_at_a_time():
    cost = {1: 4e-3, 2: 2.2e-3, 4: 1.0e-3, 8: 9e-3}  # 4 of 8 CPUs are free
    m = Machine(cost)
    tuner = ThreadTuner(8, clock=m.clock)
    m.run(tuner, 4000)
    assert tuner.threads == 4


def test_engine_steps_run_on_the_count_chosen_for_them(tiny_models, monkeypatch):
    tiny_model = tiny_models("llama")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the machine decides: a tuner on 2+ CPUs
    monkeypatch.setattr("conveyor.engine.runner.cpu_threads.affinity_cpus", lambda: 2)
    monkeypatch.setattr("conveyor.engine.runner.thread_tuner.PROBE_INTERVAL_S", 0.0)  # probe all the time
    before = torch.get_num_threads()
    try:
        llm = LLM(tiny_model, num_kv_blocks=64)
        engine = llm.engine
        assert engine.cpu_budget.threads == 2 and engine.thread_tuner is not None
        chosen: list[int] = []
        seen: list[int] = []
        tuner_before = engine.thread_tuner.before_step

        def before_step() -> int:
            chosen.append(tuner_before())
            return chosen[-1]

        execute = engine.runner.execute

        def recording_execute(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return execute(*args, **kwargs)

        monkeypatch.setattr(engine.thread_tuner, "before_step", before_step)
        monkeypatch.setattr(engine.runner, "execute", recording_execute)
        llm.generate(["a b c"] * 4, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert seen == chosen and set(seen) == {1, 2}, (chosen, seen)  # probes ran on 1 thread, the rest on 2
        assert engine.stats().cpu_threads == seen[-1]

        fixed = LLM(tiny_model, num_kv_blocks=64, cpu_threads=1).engine
        assert fixed.thread_tuner is None and fixed.cpu_budget.describe().startswith("1 torch threads (cpu_threads;")
        torch.set_num_threads(2)  # another engine or library changed it: the next step puts it back
        fixed.add_request("r", "a b c", SamplingParams(max_tokens=2))
        fixed.step()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
