"""The engine host shares the engine between owners (``conveyor.worker.execution.fair_feed``): the
next request is the one of the owner with the fewest in the engine, so a newcomer's first
request does not wait behind another owner's backlog; a shorter deadline orders requests
only within one owner. Checked on the feed alone and on a real engine (tiny model)."""

from __future__ import annotations

import threading

import pytest

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.worker.execution.engine_host import EngineHost, RequestHandle
from conveyor.worker.execution.fair_feed import FairFeed, OwnerLoad


def test_the_owner_with_fewest_served_goes_next_and_ties_take_turns() -> None:
    feed: FairFeed[str] = FairFeed()
    for i in range(4):
        feed.put(f"a{i}", "A", f"a{i}")
    feed.put("b0", "B", "b0")
    feed.put("b1", "B", "b1")
    feed.put("c0", "C", "c0")
    order = [feed.pop() for _ in range(5)]
    assert order == [("A", "a0"), ("B", "b0"), ("C", "c0"), ("A", "a1"), ("B", "b1")]
    assert feed.loads() == [OwnerLoad("A", 2, 2), OwnerLoad("B", 2, 0), OwnerLoad("C", 1, 0)]
    feed.done("C")
    feed.put("c1", "C", "c1")
    assert feed.pop() == ("C", "c1")  # C has 0 in the engine now: before A's third
    assert feed.pop() == ("A", "a2")


def test_a_newcomer_goes_before_a_backlog_whatever_its_deadline() -> None:
    feed: FairFeed[str] = FairFeed()
    for i in range(3):
        feed.put(f"a{i}", "A", f"a{i}", deadline=100.0)  # due in an hour
    assert feed.pop() == ("A", "a0")
    feed.put("b", "B", "b", deadline=10_000.0)  # due much later
    assert feed.pop() == ("B", "b")


def test_within_one_owner_priority_then_deadline_then_arrival() -> None:
    feed: FairFeed[str] = FairFeed()
    feed.put("late", "A", "late", deadline=500.0)
    feed.put("none", "A", "none")
    feed.put("soon", "A", "soon", deadline=100.0)
    feed.put("urgent", "A", "urgent", priority=-5, deadline=900.0)
    feed.put("soon2", "A", "soon2", deadline=100.0)
    assert [feed.pop() for _ in range(5)] == [("A", x) for x in ("urgent", "soon", "soon2", "late", "none")]
    assert feed.pop() is None


def test_remove_takes_back_a_held_item_only() -> None:
    feed: FairFeed[str] = FairFeed()
    feed.put("a0", "A", "a0")
    feed.put("a1", "A", "a1")
    assert feed.remove("a0") == "a0" and feed.remove("a0") is None
    assert len(feed) == 1 and feed.pop() == ("A", "a1")
    feed.done("A")
    assert feed.loads() == [] and len(feed) == 0


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(EngineConfig(model=tiny_models("llama"), num_kv_blocks=256, max_num_seqs=4))


def test_a_second_owners_request_overtakes_the_first_owners_backlog(engine) -> None:
    host = EngineHost(engine)
    finished: list[str] = []
    lock = threading.Lock()

    def done(handle: RequestHandle) -> None:
        with lock:
            finished.append(handle.tag)

    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    try:
        backlog = [host.submit([1, 2, 3, i], params, tag=f"a{i}", owner="A", on_done=done) for i in range(24)]
        b = host.submit([5, 6, 7], params, tag="b", owner="B", on_done=done, deadline=1e12)
        b.future.result(timeout=120)
        with lock:
            before_b = finished.index("b")
        # The engine holds 4 at once: B's request went in at the first free place, not after
        # the 24 of A that were submitted before it (FIFO would make it the 25th).
        assert before_b <= 8, finished
        for h in backlog:
            h.future.result(timeout=120)
        assert sorted(finished) == sorted([f"a{i}" for i in range(24)] + ["b"])
    finally:
        host.close()


def test_the_fair_share_figure_and_its_bounded_labels() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from conveyor.worker.execution.engine_host import HostStats
    from conveyor.worker.metrics.fair_share_collector import FairShareCollector, fair_share_ratio

    assert fair_share_ratio([OwnerLoad("a", 4, 20), OwnerLoad("b", 0, 1)]) == 0.0  # b waits with nothing in
    assert fair_share_ratio([OwnerLoad("a", 3, 20), OwnerLoad("b", 1, 0)]) == 1.0  # b wants no more
    assert fair_share_ratio([OwnerLoad("a", 3, 20), OwnerLoad("b", 1, 5)]) == 0.5  # b has half an equal share
    assert fair_share_ratio([OwnerLoad("a", 2, 20), OwnerLoad("b", 2, 5)]) == 1.0
    assert fair_share_ratio([]) == 1.0

    loads = tuple(OwnerLoad(f"key_{i}", 10 - i, i) for i in range(7))
    stats = HostStats(None, 0, 0, 0, 0.0, loads)
    registry = CollectorRegistry()
    registry.register(FairShareCollector(lambda: stats, "m"))
    text = generate_latest(registry).decode()
    assert "key_" not in text  # owners are never labels
    ranks = [line for line in text.splitlines() if line.startswith("conveyor_owner_share{")]
    assert len(ranks) == 5 and 'rank="rest"' in ranks[-1]
    assert 'conveyor_fair_share_owners{model="m",state="waiting"} 6.0' in text
    served = sum(10 - i for i in range(7))
    assert f'conveyor_owner_share{{model="m",rank="1"}} {10 / served}' in text
