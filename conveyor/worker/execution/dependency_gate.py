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
        deadline: float | None = None
        pause = FIRST_PAUSE

        def stopping() -> bool:
            return (stop is not None and stop()) or (give_up is not None and give_up())

        def check_give_up(dependency: str) -> None:
            if give_up is not None and give_up():
                raise DependencyUnavailable(dependency, f"{what}: {dependency} down and the worker is stopping")

        while True:
            if self.down():
                if deadline is None:
                    deadline = time.monotonic() + patience
                if not self.wait(max(0.0, deadline - time.monotonic()), stopping):
                    down = ", ".join(self.down()) or "a dependency"
                    check_give_up(down)
                    if not (stop is not None and stop()):
                        raise DependencyUnavailable(down, f"{what}: {down} still down after {patience:.0f} s")
            try:
                return fn()
            except DependencyUnavailable:
                raise
            except Exception as exc:
                dependency = self.report(exc)
                if dependency is None:
                    raise
                if deadline is None:
                    deadline = time.monotonic() + patience
                check_give_up(dependency)
                if time.monotonic() >= deadline:
                    raise DependencyUnavailable(
                        dependency, f"{what}: {dependency} still down after {patience:.0f} s: {_summary(exc)}"
                    ) from exc
                log.debug("%s: %s down (%s); waiting for it", what, dependency, _summary(exc))
            # The gate may open at once (a blip, or a check that passes while this call still
            # fails): pause between this call's own tries too, so it never spins.
            self._closed.wait(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, self._backoff_max)

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
