"""The engine host: one loop thread owns the engine; any thread submits, aborts, reads stats."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait
from typing import cast

import pytest

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.worker.execution.engine_host import EngineFailure, EngineHost, HostClosed, RequestHandle


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(EngineConfig(model=tiny_models("llama"), num_kv_blocks=256, max_num_seqs=32))


@pytest.fixture
def host(engine):
    h = EngineHost(engine)
    yield h
    h.close()


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_requests_from_many_threads_share_the_engine(host) -> None:
    handles = []
    lock = threading.Lock()

    def submit(t: int) -> None:
        for i in range(8):
            h = host.submit(f"The guest {t} orders soup {i}", GREEDY, tag=(t, i))
            with lock:
                handles.append(h)

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done, pending = wait([h.future for h in handles], timeout=60)
    assert not pending and len(done) == 32
    for h in handles:
        c = h.future.result()
        assert not c.rejected and len(c.outputs) == 1
        assert c.outputs[0].finished and len(c.outputs[0].token_ids) == 8
    assert len({h.request_id for h in handles}) == 32
    stats = host.stats()
    assert stats.submitted == 32 and stats.finished == 32


def test_same_prompt_gives_same_greedy_text_alone_or_batched(host) -> None:
    alone = host.submit("A chef and a waiter", GREEDY).future.result(30)
    many = [host.submit(f"noise {i} tea", GREEDY) for i in range(6)]
    batched = host.submit("A chef and a waiter", GREEDY).future.result(30)
    wait([h.future for h in many], timeout=30)
    assert alone.outputs[0].token_ids == batched.outputs[0].token_ids


def test_n_samples_resolve_together_in_index_order(host) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=3)
    c = host.submit({"messages": [{"role": "user", "content": "hi"}]}, params).future.result(30)
    assert [o.index for o in c.outputs] == [0, 1, 2] and all(o.finished for o in c.outputs)


def test_rejected_request_resolves_with_the_engines_message(host) -> None:
    c = host.submit([10**9], GREEDY).future.result(10)
    assert c.rejected and "vocabulary" in c.error
    ok = host.submit("still serving", GREEDY).future.result(30)
    assert not ok.rejected


def test_abort_resolves_as_aborted_and_frees_the_slot(host) -> None:
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    h = host.submit("a long story about soup", long)
    time.sleep(0.2)
    host.abort(h)
    c = h.future.result(10)
    assert c.aborted and c.outputs[0].finish_reason == "abort" and len(c.outputs[0].token_ids) < 2000
    early = host.submit("never runs", long)
    host.abort(early)
    assert early.future.result(10).aborted


def test_on_done_callback_gets_each_handle(host) -> None:
    seen: list[RequestHandle] = []
    hs = [host.submit(f"bread {i}", GREEDY, on_done=seen.append) for i in range(5)]
    wait([h.future for h in hs], timeout=30)
    deadline = time.monotonic() + 10  # callbacks run just after their futures complete
    while len(seen) < len(hs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(h.request_id for h in seen) == sorted(h.request_id for h in hs)


class _FakeEngine:
    """Counts calls; can fail a step; requests finish on the first step."""

    def __init__(self, fail_step: bool = False) -> None:
        self.calls = 0
        self.fail_step = fail_step
        self.live: dict[str, SamplingParams] = {}
        self.tokenizer = None

    def add_request(self, rid, prompt, params, priority=0, deadline=None):
        self.calls += 1
        if prompt == "bad":
            raise ValueError("bad prompt")
        self.live[rid] = params

    def has_unfinished_requests(self):
        self.calls += 1
        return bool(self.live)

    def abort_request(self, rid):
        self.live.pop(rid, None)

    def step(self):
        self.calls += 1
        if self.fail_step:
            raise RuntimeError("boom")
        from conveyor.engine import RequestMetrics, RequestOutput

        outs = [
            RequestOutput(rid, [1], [2], "x", [2], "x", True, "stop", 0, RequestMetrics(arrival_time=0.0))
            for rid in self.live
        ]
        self.live.clear()
        return outs

    def stats(self):
        return None


def test_idle_loop_sleeps_instead_of_spinning() -> None:
    fake = _FakeEngine()
    host = EngineHost(cast("LLMEngine", fake))  # a duck-typed stand-in for the engine methods the host calls
    try:
        assert host.submit("x", GREEDY).future.result(5).outputs[0].text == "x"
        before = fake.calls
        time.sleep(0.5)
        assert fake.calls - before <= 2, "the loop polled the engine while idle"
    finally:
        host.close()


def test_a_failing_step_fails_every_in_flight_future_and_the_loop_survives() -> None:
    fake = _FakeEngine(fail_step=True)
    host = EngineHost(cast("LLMEngine", fake))  # a duck-typed stand-in for the engine methods the host calls
    try:
        hs = [host.submit(f"p{i}", GREEDY) for i in range(3)]
        for h in hs:
            with pytest.raises(EngineFailure, match="boom"):
                h.future.result(5)
        assert host.submit("bad", GREEDY).future.result(5).rejected
        fake.fail_step = False
        assert host.submit("good", GREEDY).future.result(5).outputs
    finally:
        host.close()


def test_close_fails_what_is_left_and_refuses_new_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeEngine()

    def step() -> list:
        time.sleep(0.2)
        return []  # never finishes anything

    monkeypatch.setattr(fake, "step", step)
    host = EngineHost(cast("LLMEngine", fake))  # a duck-typed stand-in for the engine methods the host calls
    h = host.submit("forever", GREEDY)
    time.sleep(0.05)
    host.close()
    with pytest.raises(HostClosed):
        h.future.result(5)
    with pytest.raises(HostClosed):
        host.submit("late", GREEDY)


def test_text_the_tokenizer_cannot_take_is_rejected_alone(host) -> None:
    """A lone surrogate (a JSON \\udce9 escape) is a rejected request (a 400 in the job path),
    not an engine failure that fails everything in flight."""
    good = host.submit("A chef and a waiter", GREEDY)
    bad = host.submit("caf\udce9", GREEDY)
    rejected = bad.future.result(30)
    assert rejected.rejected and rejected.error is not None and "lone surrogate" in rejected.error
    done = good.future.result(30)
    assert not done.rejected and done.outputs[0].finished and len(done.outputs[0].token_ids) == 8
