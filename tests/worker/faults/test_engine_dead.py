"""A worker whose engine can run no further step (a tensor-parallel rank died) exits, so that
its shards go back through their leases to be retried, instead of storing an error for every
item it is given from then on."""

from __future__ import annotations

import threading
from typing import cast

import pytest

from conveyor.engine import EngineDeadError, LLMEngine, SamplingParams
from conveyor.worker.execution import engine_host
from conveyor.worker.execution.engine_host import ENGINE_DEAD_EXIT_CODE, EngineHost


class _DeadEngine:
    def __init__(self) -> None:
        self.live: set[str] = set()
        self.tokenizer = None

    def add_request(self, rid, prompt, params, priority=0, deadline=None):
        self.live.add(rid)

    def has_unfinished_requests(self):
        return bool(self.live)

    def abort_request(self, rid):
        self.live.discard(rid)

    def step(self):
        raise EngineDeadError("tensor-parallel rank 1 died (exit code -9)")

    def stats(self):
        return None


def test_a_dead_engine_exits_the_worker_process(monkeypatch: pytest.MonkeyPatch) -> None:
    exited: list[int] = []
    done = threading.Event()

    def fake_exit(code: int) -> None:
        exited.append(code)
        done.set()
        threading.Event().wait()  # the loop thread (a daemon) stops here, as the real exit stops the process

    monkeypatch.setattr(engine_host.os, "_exit", fake_exit)
    host = EngineHost(cast("LLMEngine", _DeadEngine()))  # a duck-typed stand-in for the engine
    handle = host.submit("x", SamplingParams(max_tokens=4))
    try:
        assert done.wait(10)
        assert exited == [ENGINE_DEAD_EXIT_CODE]
        assert not handle.done()  # no error stored for the item: its shard is retried elsewhere
    finally:
        host.close(timeout=0)
