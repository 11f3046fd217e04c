"""Requests waiting for the engine, shared fairly between owners.

The engine host puts every submitted request here and takes the next one out whenever the
engine has room (``EngineHost``: fewer unfinished requests than its ``max_num_seqs``), so
the engine's own waiting queue stays short and the order in which requests enter it is
decided here, between owners: the next request is the one of the owner with the fewest
requests in the engine now (ties: the owner served longest ago), so a newcomer's first
request goes in as soon as one request of a big backlog finishes. Within one owner: the
job's priority first (lower first, as the engine's ``priority`` policy orders it), then its
deadline (the completion window: a shorter one is served sooner, but only among that
owner's own requests), then arrival.

An owner is a job's API key id; jobs with none (the CLI, broker submissions) share the
owner ``""``. Only the loop thread of the engine host calls it (no lock).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class OwnerLoad:
    """One owner's requests: in the engine (``served``) and held here (``waiting``)."""

    owner: str
    served: int
    waiting: int


class FairFeed(Generic[T]):
    def __init__(self) -> None:
        self._queues: dict[str, list[tuple[int, float, int, str]]] = {}
        self._items: dict[str, tuple[str, T]] = {}  # key -> (owner, item)
        self._served: Counter[str] = Counter()
        self._last_turn: dict[str, int] = {}
        self._seq = itertools.count()
        self._turns = itertools.count(1)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: str, owner: str, item: T, *, priority: int = 0, deadline: float | None = None) -> None:
        """Hold ``item`` (``key`` unique) for ``owner``, ordered within it by priority (lower
        first), then deadline."""
        entry = (priority, math.inf if deadline is None else deadline, next(self._seq), key)
        heapq.heappush(self._queues.setdefault(owner, []), entry)
        self._items[key] = (owner, item)

    def remove(self, key: str) -> T | None:
        """Take back a held item (an abort before it reached the engine); None if not held."""
        held = self._items.pop(key, None)
        if held is None:
            return None
        owner, item = held
        queue = [e for e in self._queues[owner] if e[3] != key]
        heapq.heapify(queue)
        self._set_queue(owner, queue)
        return item

    def pop(self) -> tuple[str, T] | None:
        """The next item for the engine and its owner (counted served until ``done``)."""
        if not self._queues:
            return None
        owner = min(self._queues, key=lambda o: (self._served[o], self._last_turn.get(o, 0)))
        queue = self._queues[owner]
        key = heapq.heappop(queue)[3]
        self._set_queue(owner, queue)
        self._served[owner] += 1
        self._last_turn[owner] = next(self._turns)
        return owner, self._items.pop(key)[1]

    def done(self, owner: str) -> None:
        """One of ``owner``'s requests left the engine."""
        self._served[owner] -= 1
        if self._served[owner] <= 0:
            del self._served[owner]
            if owner not in self._queues:
                self._last_turn.pop(owner, None)

    def drain(self) -> list[T]:
        """Everything held (the host is closing)."""
        items = [item for _owner, item in self._items.values()]
        self._items.clear()
        self._queues.clear()
        return items

    def loads(self) -> list[OwnerLoad]:
        """Every owner with requests in the engine or held, most served first."""
        owners = set(self._served) | set(self._queues)
        loads = [OwnerLoad(o, self._served.get(o, 0), len(self._queues.get(o, ()))) for o in owners]
        return sorted(loads, key=lambda load: (-load.served, -load.waiting, load.owner))

    def _set_queue(self, owner: str, queue: list[tuple[int, float, int, str]]) -> None:
        if queue:
            self._queues[owner] = queue
            return
        del self._queues[owner]
        if not self._served.get(owner):
            self._last_turn.pop(owner, None)
