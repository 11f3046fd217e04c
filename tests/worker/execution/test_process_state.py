"""A worker process's phases, its drain timing and idle clock, and the health endpoints its
metrics server answers (in-process: the real-process behaviour is in ``test_drain.py``)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import Counter

from conveyor.worker.execution import process_state
from conveyor.worker.execution.process_state import Phase, ProcessState
from conveyor.worker.metrics.registry import new_registry
from conveyor.worker.metrics.server import MetricsServer


def test_phases_only_move_forward_and_a_drain_keeps_its_first_deadline() -> None:
    state = ProcessState()
    assert state.phase is Phase.starting and not state.draining
    state.advance(Phase.loading)
    state.advance(Phase.ready)
    state.advance(Phase.loading)  # never back
    assert state.phase is Phase.ready
    drain = state.begin_drain(20.0, "SIGTERM")
    assert state.phase is Phase.draining and state.draining
    assert drain.deadline - drain.started_at == pytest.approx(20.0)
    assert drain.deadline - drain.hand_back_at == pytest.approx(4.0)  # a fifth kept to hand back and exit
    assert not state.hand_back_due()
    assert state.begin_drain(1.0, "again") == drain  # the first call decides
    state.advance(Phase.ready)
    assert state.phase is Phase.draining


@pytest.mark.parametrize(("timeout", "margin"), [(0.5, 0.25), (3.0, 1.0), (300.0, 10.0)])
def test_the_hand_back_margin_is_a_fifth_of_the_timeout_within_bounds(timeout: float, margin: float) -> None:
    drain = ProcessState().begin_drain(timeout, "SIGTERM")
    assert drain.deadline - drain.hand_back_at == pytest.approx(margin)


def test_hand_back_is_due_at_the_hand_back_time(monkeypatch) -> None:
    now = [1000.0]  # the module's clock, moved by hand: no race with a loaded machine
    monkeypatch.setattr(process_state, "time", SimpleNamespace(monotonic=lambda: now[0]))
    state = ProcessState()
    drain = state.begin_drain(0.2, "SIGTERM")  # margin 0.1 s
    assert (drain.hand_back_at, drain.deadline) == (pytest.approx(1000.1), pytest.approx(1000.2))
    assert not state.hand_back_due()
    now[0] = 1000.099
    assert not state.hand_back_due()
    now[0] = 1000.1
    assert state.hand_back_due()


def test_the_idle_clock_starts_at_ready_and_stops_while_a_task_runs() -> None:
    state = ProcessState()
    time.sleep(0.1)
    assert state.idle_seconds() == 0.0  # loading the model is not idleness
    state.advance(Phase.ready)
    time.sleep(0.1)
    assert 0.05 < state.idle_seconds() < 5
    state.task_started()
    state.task_started()
    time.sleep(0.1)
    assert state.idle_seconds() == 0.0
    state.task_finished()
    assert state.idle_seconds() == 0.0  # one still runs
    before_end = time.monotonic()
    state.task_finished()
    time.sleep(0.05)
    idle, since_before = state.idle_seconds(), time.monotonic() - before_end
    # Counted from the last task's end, not from ready (over 0.3 s ago): bounded by the time
    # measured around it, however slow a loaded machine makes this thread.
    assert 0.05 <= idle <= since_before


def _get(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def test_the_metrics_server_answers_health_and_readiness_beside_metrics() -> None:
    registry = new_registry()
    Counter("conveyor_things", "things", registry=registry).inc(3)
    ready = {"ok": False}

    def readiness() -> tuple[bool, dict]:
        return ready["ok"], {"phase": "ready" if ready["ok"] else "loading"}

    def broken() -> tuple[bool, dict]:
        raise RuntimeError("cannot tell")

    server = MetricsServer(registry, "127.0.0.1", 0, liveness=lambda: (True, {"status": "alive"}), readiness=readiness)
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert _get(f"{base}/healthz")[0] == 200
        status, content_type, body = _get(f"{base}/readyz")
        assert (status, content_type, json.loads(body)) == (503, "application/json", {"phase": "loading"})
        ready["ok"] = True
        assert _get(f"{base}/readyz")[0] == 200
        assert _get(f"{base}/readyz", "HEAD")[:2] == (200, "application/json")
        status, _, body = _get(f"{base}/metrics")
        assert status == 200 and b"conveyor_things_total 3.0" in body
        assert _get(f"{base}/other")[0] == 404
    finally:
        server.close()
    failing = MetricsServer(registry, "127.0.0.1", 0, liveness=broken)
    try:
        status, _, body = _get(f"http://127.0.0.1:{failing.port}/healthz")
        assert status == 503 and "RuntimeError: cannot tell" in json.loads(body)["error"]
        assert _get(f"http://127.0.0.1:{failing.port}/readyz")[0] == 404  # not given: not served
    finally:
        failing.close()
