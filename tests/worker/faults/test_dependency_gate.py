"""Dependency faults: which errors are an outage (not the work's fault), and the gate that
pauses work while a dependency is down and says so once."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from conveyor.worker.execution.dependency_gate import DependencyGate, DependencyUnavailable
from conveyor.worker.store.faults import DATABASE, STORAGE, dependency_of
from conveyor.worker.store.objects.base import StorageUnavailable


def _error_from(url: str, sql: str = "SELECT 1") -> BaseException:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text(sql))
    except Exception as exc:
        return exc
    finally:
        engine.dispose()
    raise AssertionError("no error")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_outages_are_told_apart_from_the_works_own_errors(tmp_path, pg_admin_user) -> None:
    refused = _error_from(f"postgresql+psycopg://{pg_admin_user}@127.0.0.1:{_closed_port()}/test")
    assert isinstance(refused, OperationalError) and dependency_of(refused) == DATABASE
    no_file = _error_from(f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}")
    assert dependency_of(no_file) == DATABASE
    no_table = _error_from(f"sqlite:///{tmp_path / 'x.db'}", "SELECT * FROM no_such_table")
    assert isinstance(no_table, OperationalError) and dependency_of(no_table) is None  # a bug, not an outage
    assert dependency_of(StorageUnavailable("endpoint unreachable", transient=True)) == STORAGE
    assert dependency_of(StorageUnavailable("no such bucket", transient=False)) is None
    try:
        raise RuntimeError("while storing") from StorageUnavailable("5xx", transient=True)
    except RuntimeError as wrapped:
        assert dependency_of(wrapped) == STORAGE
    assert dependency_of(ValueError("bad prompt")) is None


class _Flaky:
    """A dependency that is down until ``up`` is set."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        if not self.up.is_set():
            raise StorageUnavailable("still down", transient=True)


def test_the_gate_pauses_work_until_the_dependency_is_back_and_says_so_once(caplog) -> None:
    storage = _Flaky()
    gate = DependencyGate({STORAGE: storage.check}, backoff_max=0.2)
    calls: list[float] = []

    def use_storage() -> str:
        calls.append(time.monotonic())
        storage.check()
        return "stored"

    caplog.set_level(logging.WARNING, logger="conveyor.worker.execution.dependency_gate")
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(gate.call(use_storage, what="work", patience=30)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    assert gate.down() == [STORAGE] and results == []
    tries_while_down = len(calls)
    assert tries_while_down <= 4 * 4, "callers must wait on the gate, not spin"
    storage.up.set()
    for t in threads:
        t.join(5)
    assert results == ["stored"] * 4 and gate.down() == []
    messages = [r.getMessage() for r in caplog.records]
    assert sum("storage unreachable" in m and "pausing new shards" in m for m in messages) == 1
    assert sum("storage back" in m for m in messages) == 1
    gate.close()


def test_the_gate_passes_other_errors_through_and_gives_up_after_its_patience() -> None:
    storage = _Flaky()
    gate = DependencyGate({STORAGE: storage.check}, backoff_max=0.2)

    def bug() -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        gate.call(bug, what="work", patience=30)
    assert gate.down() == []
    started = time.monotonic()
    with pytest.raises(DependencyUnavailable, match="storage still down") as info:
        gate.call(storage.check, what="work", patience=1.0)
    assert info.value.dependency == STORAGE and time.monotonic() - started < 5
    with pytest.raises(DependencyUnavailable):  # still down: a new caller waits its own patience
        gate.call(storage.check, what="work", patience=0.5)
    gate.close()


def test_a_stopping_worker_gives_up_waiting_for_a_dependency_at_once() -> None:
    """``give_up`` (the worker is draining) ends a wait long before its patience, with the
    reason; while the dependency is up, ``give_up`` changes nothing."""
    storage = _Flaky()
    gate = DependencyGate({STORAGE: storage.check}, backoff_max=0.2)
    stopping = threading.Event()
    outcome: list[BaseException] = []

    def wait_for_storage() -> None:
        try:
            gate.call(storage.check, what="shard x/0", patience=600, give_up=stopping.is_set)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_storage)
    waiter.start()
    time.sleep(0.5)
    assert outcome == [] and gate.down() == [STORAGE]
    started = time.monotonic()
    stopping.set()
    waiter.join(5)
    assert time.monotonic() - started < 2
    assert len(outcome) == 1 and isinstance(outcome[0], DependencyUnavailable)
    assert "the worker is stopping" in str(outcome[0]) and outcome[0].dependency == STORAGE
    storage.up.set()
    assert gate.wait(timeout=5)
    assert gate.call(lambda: "done", what="shard x/1", patience=600, give_up=stopping.is_set) == "done"
    gate.close()
