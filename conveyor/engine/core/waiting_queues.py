"""The waiting queue of each scheduling policy (``EngineConfig.scheduling_policy``), behind
one interface: ``WaitingQueue``. The scheduler only calls its methods; a new policy is a new
subclass here and one entry in ``WAITING_QUEUES``.

- ``fcfs``: arrival order.
- ``priority``: lowest ``priority`` value first; among equals the earliest ``deadline``
  (requests without one after those with one), then arrival order.
- ``prefix``: FCFS with the head of the queue regrouped by shared prefix.
- ``srpf``: shortest remaining prefill first, the tokens the prefix cache already holds not
  counted; a request that has waited ``SRPF_AGING_STEPS`` scheduler steps is aged, and aged
  requests are admitted ahead of every other, in arrival order (the starvation bound).
- ``edf``: earliest ``deadline`` first (requests without one after all that have one), then
  ``priority``, then arrival order; preemption takes the latest deadline first.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator

from conveyor.engine.core.cached_prefix import reusable_prefix
from conveyor.engine.core.request import Request
from conveyor.engine.memory.request_memory import RequestMemory

# The prefix-aware policy reorders at most this many requests at the head of the queue per
# step, so its cost stays bounded however many thousands are waiting.
PREFIX_POLICY_WINDOW = 128
# Under ``srpf`` a request waiting this many scheduler steps is admitted ahead of every shorter
# request that has not waited as long: no prompt waits more than this (plus the aged requests
# queued before it) however many short ones keep arriving.
SRPF_AGING_STEPS = 512


class WaitingQueue:
    """The interface, and the FCFS policy: arrival order; preempted requests go back to the front."""

    def __init__(self, kv: RequestMemory, aging_steps: int = SRPF_AGING_STEPS) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        """A preempted request goes back."""
        self._q.appendleft(req)

    def tick(self) -> None:
        """A scheduler step begins (only policies that age their requests count them)."""

    def reorder(self, kv: RequestMemory) -> None:
        """Admission is about to start with more than one request waiting: a policy that looks
        at the prefix cache reorders its head against the cache as it is now."""

    def order_running(self, running: list[Request]) -> None:
        """Sort the running requests so that the last is the first to preempt (in place);
        by default they stay in admission order."""

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


def _deadline_key(req: Request) -> tuple[bool, float]:
    """Earliest deadline first, requests without one after every request that has one."""
    return (req.deadline is None, 0.0 if req.deadline is None else req.deadline)


def priority_key(req: Request) -> tuple[int, bool, float, int]:
    return (req.priority, *_deadline_key(req), req.arrival_seq)


def deadline_key(req: Request) -> tuple[bool, float, int, int]:
    return (*_deadline_key(req), req.priority, req.arrival_seq)


class KeyedWaitingQueue(WaitingQueue):
    """The smallest ``key(req)`` first (its last element is the unique ``arrival_seq``);
    preempted requests keep their key. Running requests are kept in the same order, so the
    last of them in it is the first preempted."""

    key: Callable[[Request], tuple] = staticmethod(priority_key)

    def __init__(self, kv: RequestMemory, aging_steps: int = SRPF_AGING_STEPS) -> None:
        self._heap: list[tuple[tuple, Request]] = []

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (self.key(req), req))

    push_front = push

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=self.key)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[1] for e in self._heap)


class PriorityWaitingQueue(KeyedWaitingQueue):
    """Lowest ``priority`` value first, then the earliest deadline, then arrival order."""

    key = staticmethod(priority_key)


class DeadlineWaitingQueue(KeyedWaitingQueue):
    """Earliest deadline first (none: after all that have one), then priority, then arrival."""

    key = staticmethod(deadline_key)


class SRPFWaitingQueue(WaitingQueue):
    """Shortest remaining prefill first, with aging.

    A request's remaining prefill is its tokens less the prefix the cache holds for it; it is
    scored when queued and re-scored against the cache each step for the ``PREFIX_POLICY_WINDOW``
    shortest (``reorder``), so a prompt whose prefix a sibling has just computed moves up.
    Each scheduler step is a tick (``tick``): a request queued ``aging_steps`` ticks ago is
    aged and comes before every request that is not, aged ones in arrival order. A preempted
    request is aged at once (it goes back to the front, as under FCFS)."""

    def __init__(self, kv: RequestMemory, aging_steps: int = SRPF_AGING_STEPS) -> None:
        self.kv = kv
        self.aging_steps = aging_steps
        self.step = 0
        # Entries are [remaining, arrival_seq, req, live]; arrival_seq is unique, so the heap
        # never compares requests. Dead entries (popped, removed) are dropped lazily.
        self._heap: list[list] = []
        self._fifo: deque[tuple[float, list]] = deque()  # (queued at step, entry), arrival order
        self._entries: dict[Request, list] = {}

    def _remaining(self, req: Request) -> int:
        return req.num_tokens - reusable_prefix(self.kv, req)[1]

    def _push(self, req: Request, queued_at: float, front: bool) -> None:
        entry = [self._remaining(req), req.arrival_seq, req, True]
        self._entries[req] = entry
        heapq.heappush(self._heap, entry)
        if front:
            self._fifo.appendleft((queued_at, entry))
        else:
            self._fifo.append((queued_at, entry))

    def push(self, req: Request) -> None:
        self._push(req, self.step, front=False)

    def push_front(self, req: Request) -> None:
        self._push(req, -math.inf, front=True)

    def tick(self) -> None:
        self.step += 1

    def peek(self) -> Request:
        fifo, heap = self._fifo, self._heap
        while fifo and not fifo[0][1][3]:
            fifo.popleft()
        if fifo and self.step - fifo[0][0] >= self.aging_steps:
            return fifo[0][1][2]
        while not heap[0][3]:
            heapq.heappop(heap)
        return heap[0][2]

    def pop(self) -> Request:
        req = self.peek()
        self.remove(req)
        return req

    def remove(self, req: Request) -> None:
        self._entries.pop(req)[3] = False

    def reorder(self, kv: RequestMemory) -> None:
        """Re-score the shortest ``PREFIX_POLICY_WINDOW`` against the cache as it is now."""
        window: list[list] = []
        while self._heap and len(window) < PREFIX_POLICY_WINDOW:
            entry = heapq.heappop(self._heap)
            if entry[3]:
                entry[0] = self._remaining(entry[2])
                window.append(entry)
        for entry in window:
            heapq.heappush(self._heap, entry)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._entries))


class PrefixAwareWaitingQueue(WaitingQueue):
    """FCFS, except that each step the head of the queue is reordered: the longest cached
    prefix first (it is cheapest to admit and keeps its blocks warm), and requests whose
    first block is the same grouped together in order of their group's first arrival, so
    that a shared prefix is computed once and reused by the rest while it is still cached."""

    def reorder(self, kv: RequestMemory) -> None:
        window = [self._q.popleft() for _ in range(min(PREFIX_POLICY_WINDOW, len(self._q)))]
        group_first: dict[bytes, int] = {}
        scored = []
        for req in window:
            hits, _ = reusable_prefix(kv, req)  # also fills req.block_hashes
            group = req.block_hashes[0] if req.block_hashes else None
            first = req.arrival_seq if group is None else group_first.setdefault(group, req.arrival_seq)
            scored.append((-len(hits), first, req.arrival_seq, req))
        scored.sort(key=lambda t: t[:3])
        self._q.extendleft(t[3] for t in reversed(scored))


# Each scheduling policy's queue; every one is built as ``cls(kv, aging_steps)``.
WAITING_QUEUES: dict[str, type[WaitingQueue]] = {
    "fcfs": WaitingQueue,
    "priority": PriorityWaitingQueue,
    "prefix": PrefixAwareWaitingQueue,
    "srpf": SRPFWaitingQueue,
    "edf": DeadlineWaitingQueue,
}
SCHEDULING_POLICIES = tuple(WAITING_QUEUES)


def make_waiting_queue(policy: str, kv: RequestMemory, aging_steps: int = SRPF_AGING_STEPS) -> WaitingQueue:
    if policy not in WAITING_QUEUES:
        raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {SCHEDULING_POLICIES}")
    return WAITING_QUEUES[policy](kv, aging_steps)
