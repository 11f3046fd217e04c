"""How many shards each owner runs in this worker process, and which are at their limit
(``CONVEYOR_OWNER_SHARD_SLOTS``): read by ``conveyor.worker.execution.shard_turns``.

An owner that held every place here while another owner's work waited gives one back
(``ShardRunner``: its shard is handed back at a line boundary). Until another owner's shard
has started here, or ``YIELD_HOLD_SECONDS`` have passed, that owner counts as full, so the
freed place goes to the other owner and not straight back to it."""

from __future__ import annotations

import threading
import time
from collections import Counter

YIELD_HOLD_SECONDS = 30.0


class OwnerSlots:
    """The shards each owner runs in this process, up to ``per_owner`` each."""

    def __init__(self, per_owner: int) -> None:
        self.per_owner = per_owner
        self._held: Counter[str] = Counter()
        self._yielded: dict[str, float] = {}  # owner -> when it gave a place back
        self._yielding: str | None = None  # the shard handing its place back now
        self._lock = threading.Lock()

    def full(self) -> set[str]:
        with self._lock:
            cutoff = time.monotonic() - YIELD_HOLD_SECONDS
            self._yielded = {o: t for o, t in self._yielded.items() if t > cutoff}
            return {owner for owner, n in self._held.items() if n >= self.per_owner} | set(self._yielded)

    def take(self, owner: str) -> None:
        with self._lock:
            self._held[owner] += 1
            if any(o != owner for o in self._yielded):  # another owner got a place: the hold has done its job
                self._yielded.clear()

    def holds_every_place(self, owner: str, places: int) -> bool:
        with self._lock:
            return self._held.get(owner, 0) >= places and self._yielding is None

    def begin_yield(self, shard: str) -> bool:
        """True if ``shard`` may give its place back now (one shard at a time in a process)."""
        with self._lock:
            if self._yielding is not None:
                return False
            self._yielding = shard
            return True

    def end_yield(self, shard: str, owner: str, gave_back: bool) -> None:
        """``shard`` ended (its turn is over); if it gave its place back, ``owner`` is held off
        the next turns here for a while."""
        with self._lock:
            if self._yielding == shard:
                self._yielding = None
            if gave_back:
                self._yielded[owner] = time.monotonic()

    def release(self, owner: str) -> None:
        with self._lock:
            self._held[owner] -= 1
            if self._held[owner] <= 0:
                del self._held[owner]

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)
