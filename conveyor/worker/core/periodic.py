"""A daemon thread that calls a function every few seconds until stopped.

A failing call is logged once, with its traceback, and again only when the calls succeed
once more: an outage of a few minutes is two log lines, not one per interval. ``wake()``
runs the next call now instead of at the end of the interval (a worker whose broker
connection came back sweeps at once).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, interval: float, fn: Callable[[], object], *, run_first: bool = True) -> None:
        self.name, self.interval, self._fn, self._run_first = name, interval, fn, run_first
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._failing = 0  # consecutive failed calls
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Periodic:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def wake(self) -> None:
        """Make the next call now rather than at the end of the current interval."""
        self._wake.set()

    def _run(self) -> None:
        if self._run_first:
            self._call()
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._call()

    def _call(self) -> None:
        try:
            self._fn()
        except Exception:
            self._failing += 1
            if self._failing == 1:
                log.warning("%s failed (it goes on trying every %.3g s)", self.name, self.interval, exc_info=True)
            else:
                log.debug("%s failed again (%d times in a row)", self.name, self._failing, exc_info=True)
        else:
            if self._failing:
                log.warning("%s works again after %d failed calls", self.name, self._failing)
            self._failing = 0
