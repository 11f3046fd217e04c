"""The ``srpf`` and ``edf`` policies (and ``priority``'s deadline tie-break) on the scheduler
alone: deterministic, no model. A step here is the engine's with the model left out: a
request whose prefill is done gets one token, and the scheduler's update does the rest."""

from __future__ import annotations

import pytest

from conveyor.engine.core.request import Request, RequestStatus
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.memory.kv_cache import KVCacheManager
from tests.engine.helpers import make_request, step_without_model


def _sched(policy: str, *, num_blocks: int = 256, max_num_seqs: int = 1, **kw) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64, policy=policy, **kw
    )


def _step(sched: Scheduler, admitted: list[str]) -> list[Request]:
    """One engine step; appends the ids of the requests it admitted; returns those it finished."""
    before = {id(r) for r in sched.running}
    out, done = step_without_model(sched)
    admitted += [r.request_id for r in out.requests if id(r) not in before]
    return done


def _run(sched: Scheduler, reqs: list[Request]) -> tuple[list[str], dict[str, int]]:
    """Queue ``reqs`` and step to the end: (admission order, the step each finished at)."""
    for r in reqs:
        sched.add_request(r)
    admitted: list[str] = []
    finished_at: dict[str, int] = {}
    step = 0
    while sched.has_unfinished():
        step += 1
        for r in _step(sched, admitted):
            finished_at[r.request_id] = step
        assert step < 1000
    assert sched.kv.num_used_blocks == 0
    return admitted, finished_at


# ---- srpf ------------------------------------------------------------------------------


def test_srpf_admits_the_shortest_remaining_prefill_first_counting_cached_tokens():
    sched = _sched("srpf")
    prefix = list(range(1, 33))  # 8 blocks of 4
    _run(sched, [make_request(0, 0, tokens=[*prefix, 99])])  # leaves the prefix in the cache
    long_but_cached = make_request(3, 0, tokens=[*prefix, *range(200, 208)])  # 40 tokens, 8 to compute
    reqs = [make_request(1, 16), make_request(2, 12), long_but_cached, make_request(4, 4)]
    admitted, _ = _run(sched, reqs)
    assert admitted == ["r4", "r3", "r2", "r1"]  # remaining 4, 8, 12, 16
    fcfs, _ = _run(_sched("fcfs"), [make_request(1, 16), make_request(2, 12), make_request(3, 40), make_request(4, 4)])
    assert fcfs == ["r1", "r2", "r3", "r4"]


@pytest.mark.parametrize("aging_steps", [1, 5, 20])
def test_srpf_aging_bounds_how_long_a_long_prompt_waits(aging_steps):
    """A long prompt queued first, and a short one arriving every step: without aging the
    long one never runs; with it, it is admitted at exactly the ``aging_steps``-th step."""
    sched = _sched("srpf", srpf_aging_steps=aging_steps)
    sched.add_request(make_request(0, 40))
    admitted: list[str] = []
    for seq in range(1, 60):
        sched.add_request(make_request(seq, 4))
        _step(sched, admitted)
        if "r0" in admitted:
            break
    assert admitted.index("r0") == aging_steps - 1
    assert admitted[: aging_steps - 1] == [f"r{i}" for i in range(1, aging_steps)]  # shorts before it


def test_srpf_without_aging_starves_the_long_prompt():
    """What the aging bound is for: the same stream with an unreachable bound never admits it."""
    sched = _sched("srpf", srpf_aging_steps=10**9)
    sched.add_request(make_request(0, 40))
    admitted: list[str] = []
    for seq in range(1, 60):
        sched.add_request(make_request(seq, 4))
        _step(sched, admitted)
    assert "r0" not in admitted and len(admitted) == 59


def test_srpf_removes_aborted_requests():
    sched = _sched("srpf")
    a, b = make_request(0, 8), make_request(1, 4)
    sched.add_request(a)
    sched.add_request(b)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert len(sched.waiting) == 1 and list(sched.waiting) == [a]
    admitted, _ = _run(sched, [])
    assert admitted == ["r0"]


# ---- edf -------------------------------------------------------------------------------


def _deadline_case() -> list[Request]:
    # One at a time, each 1 step per output token: A takes 10 steps, B and C 5 each.
    return [
        make_request(0, 4, 10, deadline=30.0),  # A, first to arrive, due last
        make_request(1, 4, 5, deadline=6.0),  # B
        make_request(2, 4, 5, deadline=12.0),  # C
    ]


def _missed(finished_at: dict[str, int], reqs: list[Request]) -> list[str]:
    return [r.request_id for r in reqs if r.deadline is not None and finished_at[r.request_id] > r.deadline]


def test_edf_meets_every_deadline_that_fcfs_misses():
    reqs = _deadline_case()
    _, fcfs = _run(_sched("fcfs"), reqs)
    assert _missed(fcfs, reqs) == ["r1", "r2"]  # A runs first and makes B and C late
    reqs = _deadline_case()
    admitted, edf = _run(_sched("edf"), reqs)
    assert admitted == ["r1", "r2", "r0"] and _missed(edf, reqs) == []
    assert edf == {"r1": 5, "r2": 10, "r0": 20}


def test_edf_puts_requests_without_a_deadline_last_then_orders_by_priority():
    reqs = [
        make_request(0, 4),
        make_request(1, 4, deadline=2e9),
        make_request(2, 4, deadline=1e9, priority=5),
        make_request(3, 4, deadline=1e9, priority=1),
        make_request(4, 4, priority=-3),
    ]
    admitted, _ = _run(_sched("edf"), reqs)
    assert admitted == ["r3", "r2", "r1", "r4", "r0"]


def test_edf_preempts_the_latest_deadline_first():
    """Two requests growing in a cache too small for both: the one due later is preempted,
    though under FCFS the newest (here the one due sooner) would be."""

    def case() -> list[Request]:
        return [make_request(0, 8, 24, deadline=100.0), make_request(1, 8, 24, deadline=50.0)]

    for policy, victim in (("edf", "r0"), ("fcfs", "r1")):
        reqs = case()
        _run(_sched(policy, num_blocks=12, max_num_seqs=2), reqs)
        preempted = [r.request_id for r in reqs if r.metrics.num_preemptions]
        assert preempted == [victim], policy


# ---- priority with deadlines ---------------------------------------------------------------


def test_priority_breaks_ties_by_deadline():
    reqs = [
        make_request(0, 4, priority=1, deadline=1.0),  # most urgent, but less important
        make_request(1, 4, priority=0),  # no deadline: after its equals that have one
        make_request(2, 4, priority=0, deadline=9.0),
        make_request(3, 4, priority=0, deadline=3.0),
        make_request(4, 4, priority=0),
    ]
    admitted, _ = _run(_sched("priority"), reqs)
    assert admitted == ["r3", "r2", "r1", "r4", "r0"]


def test_unknown_policies_still_raise():
    with pytest.raises(ValueError, match=r"'sjf'.*'srpf', 'edf'"):
        _sched("sjf")
