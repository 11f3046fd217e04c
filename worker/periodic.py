"""A daemon thread that calls a function every few seconds until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, interval: float, fn: Callable[[], object], *, run_first: bool = True) -> None:
        self.name, self.interval, self._fn, self._run_first = name, interval, fn, run_first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Periodic:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        if self._run_first:
            self._call()
        while not self._stop.wait(self.interval):
            self._call()

    def _call(self) -> None:
        try:
            self._fn()
        except Exception:  # noqa: BLE001 - keep going; the next round may work
            log.warning("%s failed", self.name, exc_info=True)
