"""The input stage: requests prepared for the engine on a few threads of their own.

A request's chat template, tokenising and grammar compile (``LLMEngine.prepare_input``) are
per line and can be slow on hostile input; the engine's loop thread would stall every owner
behind one line. Here a bounded pool of threads prepares them instead, taking the next
request from the owner with the fewest being prepared (a ``FairFeed``, as the engine's own
admission does), so one owner's thousand long prompts hold at most the threads, never another
owner's first line. Each request is handed back prepared, or with the error that fails it
alone; the engine host admits only prepared requests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from conveyor.worker.execution.fair_feed import FairFeed

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class InputStage(Generic[T, R]):
    """``prepare(item)`` on ``threads`` threads, fair between owners; ``deliver(item, result,
    error)`` with its result or the exception it raised (never both)."""

    def __init__(
        self,
        prepare: Callable[[T], R],
        deliver: Callable[[T, R | None, Exception | None], None],
        *,
        threads: int = 2,
        name: str = "conveyor-input",
    ) -> None:
        self._prepare = prepare
        self._deliver = deliver
        self._feed: FairFeed[tuple[str, T]] = FairFeed()
        self._running: set[str] = set()
        self._cv = threading.Condition()
        self._closing = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def put(self, key: str, owner: str, item: T, *, priority: int = 0, deadline: float | None = None) -> None:
        with self._cv:
            self._feed.put(key, owner, (key, item), priority=priority, deadline=deadline)
            self._cv.notify()

    def remove(self, key: str) -> T | None:
        """Take back an item not yet being prepared (an abort); None if it is not waiting."""
        with self._cv:
            held = self._feed.remove(key)
        return None if held is None else held[1]

    def preparing(self, key: str) -> bool:
        with self._cv:
            return key in self._running

    def __len__(self) -> int:
        with self._cv:
            return len(self._feed) + len(self._running)

    def close(self) -> list[T]:
        """Stop the threads (those preparing finish their item); the items still waiting."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            return [item for _key, item in self._feed.drain()]

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (len(self._feed) or self._closing):
                    self._cv.wait()
                if self._closing:
                    return
                taken = self._feed.pop()
                assert taken is not None
                owner, (key, item) = taken
                self._running.add(key)
            result: R | None = None
            error: Exception | None = None
            try:
                result = self._prepare(item)
            except Exception as exc:  # every failure is this item's alone, delivered as its error
                error = exc
            with self._cv:
                self._running.discard(key)
                self._feed.done(owner)
            try:
                self._deliver(item, result, error)
            except Exception:
                log.exception("delivering a prepared request failed")
