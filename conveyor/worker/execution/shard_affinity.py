"""The groups of shards this worker served last: their prefixes are likely still in its
prefix cache, so its next turn prefers a pending shard of one of them
(``conveyor.worker.jobs.shard_choice``), and how often a turn found one (``conveyor_shard_affinity_hits``)."""

from __future__ import annotations

import threading
from collections import deque

RECENT_GROUPS = 8  # about what a prefix cache holds of a few shards' shared prefixes


class ShardAffinity:
    def __init__(self, remember: int = RECENT_GROUPS) -> None:
        self._recent: deque[str] = deque(maxlen=remember)
        self._lock = threading.Lock()
        self.turns = 0  # shards chosen by a turn
        self.hits = 0  # of which were of a group served last

    def recent(self) -> list[str]:
        with self._lock:
            return list(self._recent)

    def serving(self, group_key: str | None) -> bool:
        """A turn chose a shard of ``group_key``: remember the group; whether it was recent."""
        if group_key is None:
            return False
        with self._lock:
            hit = group_key in self._recent
            if hit:
                self._recent.remove(group_key)
            self._recent.append(group_key)
            return hit

    def ran(self, hit: bool) -> None:
        """A turn ran the shard it chose (not one another turn took first)."""
        with self._lock:
            self.turns += 1
            self.hits += hit
