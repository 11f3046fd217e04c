"""The process's view of its dependencies: no shard starts while the database or the object
store is known to be down, and work that hit an outage waits here for it to end.

Why: an outage is no item's fault. Counted as a failed attempt, it turned healthy items into
errors whenever it outlasted the retry backoff. Instead, the first thread that hits a
dependency fault (``conveyor.worker.store.faults``) marks the dependency down, logging it once; a
background thread checks it again with a growing pause (at most
``CONVEYOR_DEPENDENCY_BACKOFF_MAX_SECONDS``); every thread about to use it waits on the
gate; when the check succeeds the gate opens, logging it once, and they all go on.

``call(fn, ...)`` is the usual way in: wait for the gate, run ``fn``, and on a dependency
fault wait and run it again, for up to ``patience`` seconds of outage (then
``DependencyUnavailable``: the work was neither done nor failed, and the caller hands it
back). ``patience`` is the one place a deadline enters, so a job's expiry can bound it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from conveyor.worker.store.faults import dependency_of

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_PAUSE = 0.5  # seconds before the first check of a dependency that just went down
REMIND_EVERY = 300.0  # seconds between "still down" log lines


class DependencyUnavailable(RuntimeError):
    """A dependency stayed down for all the time the caller allowed; nothing was done."""

    def __init__(self, dependency: str, message: str) -> None:
        super().__init__(message)
        self.dependency = dependency


@dataclass
class _Outage:
    since: float
    error: str


def _summary(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


@dataclass
class _Patience:
    """One ``DependencyGate.call``'s waiting: its deadline (set when it first waits) and the
    callbacks that end a wait early."""

    what: str
    patience: float
    stop: Callable[[], bool] | None
    give_up: Callable[[], bool] | None
    deadline: float | None = None

    def deadline_at(self) -> float:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.patience
        return self.deadline

    def stopped(self) -> bool:
        return self.stop is not None and self.stop()

    def stopping(self) -> bool:
        return self.stopped() or (self.give_up is not None and self.give_up())

    def check_give_up(self, dependency: str) -> None:
        if self.give_up is not None and self.give_up():
            raise DependencyUnavailable(dependency, f"{self.what}: {dependency} down and the worker is stopping")

    def fault(self, dependency: str, exc: Exception) -> None:
        """``fn`` failed for ``dependency``: ``DependencyUnavailable`` when the worker is stopping
        or the patience is spent, else the call tries again."""
        deadline = self.deadline_at()
        self.check_give_up(dependency)
        if time.monotonic() >= deadline:
            raise DependencyUnavailable(
                dependency, f"{self.what}: {dependency} still down after {self.patience:.0f} s: {_summary(exc)}"
            ) from exc


class DependencyGate:
    """``checks`` maps a dependency's name to a call that raises while it is unusable."""

    def __init__(self, checks: Mapping[str, Callable[[], object]], *, backoff_max: float = 30.0) -> None:
        self._checks = dict(checks)
        self._backoff_max = backoff_max
        self._cv = threading.Condition()
        self._down: dict[str, _Outage] = {}
        self._closed = threading.Event()

    def down(self) -> list[str]:
        """The dependencies known to be down right now."""
        with self._cv:
            return sorted(self._down)

    def report(self, exc: BaseException) -> str | None:
        """If ``exc`` is a dependency fault, mark that dependency down (logged once per
        outage) and return its name; None for any other error."""
        dependency = dependency_of(exc)
        if dependency is None:
            return None
        with self._cv:
            if dependency in self._down:
                return dependency
            self._down[dependency] = _Outage(time.monotonic(), _summary(exc))
        log.warning("%s unreachable: %s; pausing new shards until it is back", dependency, _summary(exc))
        threading.Thread(
            target=self._check_until_up, args=(dependency,), name=f"conveyor-{dependency}-check", daemon=True
        ).start()
        return dependency

    def wait(self, timeout: float | None = None, stop: Callable[[], bool] | None = None) -> bool:
        """Block until no dependency is down (True), or until ``timeout`` seconds pass or
        ``stop()`` says so (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._down:
                if stop is not None and stop():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(0.5 if left is None else min(left, 0.5))
            return True

    def call(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        patience: float,
        stop: Callable[[], bool] | None = None,
        give_up: Callable[[], bool] | None = None,
    ) -> T:
        """``fn()`` once the gate is open; on a dependency fault, wait for the dependency
        and call it again. ``fn`` must be safe to call again after a fault half-way. After
        ``patience`` seconds of waiting for a dependency: ``DependencyUnavailable``.
        ``stop()`` ends a wait early and ``fn`` runs at once (to notice why: a lost lease);
        ``give_up()`` ends it with ``DependencyUnavailable`` (the worker is stopping)."""
        waiting = _Patience(what, patience, stop, give_up)
        pause = FIRST_PAUSE
        while True:
            if self.down():
                self._wait_for_gate(waiting)
            try:
                return fn()
            except DependencyUnavailable:
                raise
            except Exception as exc:
                dependency = self.report(exc)
                if dependency is None:
                    raise
                waiting.fault(dependency, exc)
                log.debug("%s: %s down (%s); waiting for it", what, dependency, _summary(exc))
            # The gate may open at once (a blip, or a check that passes while this call still
            # fails): pause between this call's own tries too, so it never spins.
            self._closed.wait(min(pause, max(0.0, waiting.deadline_at() - time.monotonic())))
            pause = min(pause * 2, self._backoff_max)

    def _wait_for_gate(self, waiting: _Patience) -> None:
        """Wait until no dependency is down; past the patience, ``DependencyUnavailable`` (unless
        ``stop()`` ended the wait: then the call runs at once)."""
        if self.wait(max(0.0, waiting.deadline_at() - time.monotonic()), waiting.stopping):
            return
        down = ", ".join(self.down()) or "a dependency"
        waiting.check_give_up(down)
        if not waiting.stopped():
            raise DependencyUnavailable(down, f"{waiting.what}: {down} still down after {waiting.patience:.0f} s")

    def close(self) -> None:
        """Stop the background checks (the process is shutting down)."""
        self._closed.set()
        with self._cv:
            self._cv.notify_all()

    def _check_until_up(self, dependency: str) -> None:
        check = self._checks.get(dependency)
        pause = FIRST_PAUSE
        next_reminder = time.monotonic() + REMIND_EVERY
        while not self._closed.wait(pause):
            try:
                if check is not None:
                    check()
            except Exception as exc:
                with self._cv:
                    outage = self._down.get(dependency)
                    if outage is not None:
                        outage.error = _summary(exc)
                if time.monotonic() >= next_reminder and outage is not None:
                    next_reminder = time.monotonic() + REMIND_EVERY
                    took = time.monotonic() - outage.since
                    log.warning("%s still unreachable after %.0f s: %s", dependency, took, outage.error)
                pause = min(pause * 2, self._backoff_max)
                continue
            # Said before the gate opens, so whoever sees it open has also seen it said.
            with self._cv:
                outage = self._down.pop(dependency, None)
                took = 0.0 if outage is None else time.monotonic() - outage.since
                log.warning("%s back after %.0f s; resuming shards", dependency, took)
                self._cv.notify_all()
            return
