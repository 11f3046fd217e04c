"""How many shards each owner runs in this worker process, and which are at their limit
(``CONVEYOR_OWNER_SHARD_SLOTS``): read by ``conveyor.worker.execution.shard_turns``."""

from __future__ import annotations

import threading
from collections import Counter


class OwnerSlots:
    """The shards each owner runs in this process, up to ``per_owner`` each."""

    def __init__(self, per_owner: int) -> None:
        self.per_owner = per_owner
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def full(self) -> set[str]:
        with self._lock:
            return {owner for owner, n in self._held.items() if n >= self.per_owner}

    def take(self, owner: str) -> None:
        with self._lock:
            self._held[owner] += 1

    def release(self, owner: str) -> None:
        with self._lock:
            self._held[owner] -= 1
            if self._held[owner] <= 0:
                del self._held[owner]

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)
