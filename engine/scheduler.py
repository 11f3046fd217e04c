"""Iteration-level scheduling under a token budget, a sequence cap and the free KV blocks.

Each step: running requests first (a decode token each, or the next chunk of an unfinished
prefill), then waiting requests admitted by policy while the budget, the cap and the free
blocks allow. When a running request cannot get a block, the request at the tail of the
running list (the newest; under ``priority`` and ``edf`` the last in the policy's order) is
preempted: its blocks are freed and it goes back to the queue (to its front under ``fcfs``,
``prefix`` and ``srpf``), to be recomputed later. Whether a waiting request may be admitted
beyond the free blocks is ``engine.admission``'s call; with an inter-token latency target, the
prefill tokens of a step (never its decodes) are limited by ``engine.chunk_budget``.

The policies (``EngineConfig.scheduling_policy``):

- ``fcfs``: arrival order.
- ``priority``: lowest ``priority`` value first; among equals the earliest ``deadline``
  (requests without one after those with one), then arrival order.
- ``prefix``: FCFS with the head of the queue regrouped by shared prefix (see below).
- ``srpf``: shortest remaining prefill first, the tokens the prefix cache already holds not
  counted; a request that has waited ``SRPF_AGING_STEPS`` scheduler steps is aged, and aged
  requests are admitted ahead of every other, in arrival order (the starvation bound).
- ``edf``: earliest ``deadline`` first (requests without one after all that have one), then
  ``priority``, then arrival order; preemption takes the latest deadline first.

Requests sharing a prefix never compute it twice: a request's full blocks are registered in
the prefix cache when they are scheduled, and a request is only admitted once every running
prefill has been scheduled to its end (an unfinished one takes all the budget left), so a
newcomer always finds the shared blocks of the requests before it.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.admission import make_admission
from engine.chunk_budget import PrefillChunkController, is_prefill
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus

# New requests are admitted only while this share of blocks stays free for running ones to
# grow into; without it a full admission makes the very next decode step preempt.
ADMISSION_WATERMARK = 0.01
# The prefix-aware policy reorders at most this many requests at the head of the queue per
# step, so its cost stays bounded however many thousands are waiting.
PREFIX_POLICY_WINDOW = 128
# Under ``srpf`` a request waiting this many scheduler steps is admitted ahead of every shorter
# request that has not waited as long: no prompt waits more than this (plus the aged requests
# queued before it) however many short ones keep arriving.
SRPF_AGING_STEPS = 512


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    # Speculative decoding: request id -> proposed tokens scheduled after its decode token
    # (counted in its ``num_new_tokens``); requests not speculated this step are absent.
    num_spec_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class WaitingQueue:
    """FCFS queue; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def tick(self) -> None:
        """A scheduler step begins (only policies that age their requests count them)."""

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
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

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (self.key(req), req))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
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

    def __init__(self, kv: KVCacheManager, aging_steps: int = SRPF_AGING_STEPS) -> None:
        self.kv = kv
        self.aging_steps = aging_steps
        self.step = 0
        # Entries are [remaining, arrival_seq, req, live]; arrival_seq is unique, so the heap
        # never compares requests. Dead entries (popped, removed) are dropped lazily.
        self._heap: list[list] = []
        self._fifo: deque[tuple[float, list]] = deque()  # (queued at step, entry), arrival order
        self._entries: dict[Request, list] = {}

    def _remaining(self, req: Request) -> int:
        return req.num_tokens - self.kv.get_computed_blocks(req)[1]

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

    def reorder(self, kv: KVCacheManager) -> None:
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

    def __iter__(self):
        return iter(list(self._entries))


class PrefixAwareWaitingQueue(WaitingQueue):
    """FCFS, except that each step the head of the queue is reordered: the longest cached
    prefix first (it is cheapest to admit and keeps its blocks warm), and requests whose
    first block is the same grouped together in order of their group's first arrival, so
    that a shared prefix is computed once and reused by the rest while it is still cached."""

    def reorder(self, kv: KVCacheManager) -> None:
        window = [self._q.popleft() for _ in range(min(PREFIX_POLICY_WINDOW, len(self._q)))]
        group_first: dict[bytes, int] = {}
        scored = []
        for req in window:
            hits, _ = kv.get_computed_blocks(req)  # also fills req.block_hashes
            group = req.block_hashes[0] if req.block_hashes else None
            first = req.arrival_seq if group is None else group_first.setdefault(group, req.arrival_seq)
            scored.append((-len(hits), first, req.arrival_seq, req))
        scored.sort(key=lambda t: t[:3])
        self._q.extendleft(t[3] for t in reversed(scored))


# The waiting queue of each scheduling policy (``EngineConfig.scheduling_policy``).
WAITING_QUEUES: dict[str, type[WaitingQueue]] = {
    "fcfs": WaitingQueue,
    "priority": PriorityWaitingQueue,
    "prefix": PrefixAwareWaitingQueue,
    "srpf": SRPFWaitingQueue,
    "edf": DeadlineWaitingQueue,
}


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        srpf_aging_steps: int = SRPF_AGING_STEPS,
        admission: str = "watermark",
        chunk_controller: PrefillChunkController | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        if policy not in WAITING_QUEUES:
            raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {tuple(WAITING_QUEUES)}")
        self.policy = policy
        queue_cls = WAITING_QUEUES[policy]
        self.waiting = SRPFWaitingQueue(kv, srpf_aging_steps) if queue_cls is SRPFWaitingQueue else queue_cls()
        # The order running requests are kept in (the last is the first preempted); None: admission order.
        self._running_key = queue_cls.key if issubclass(queue_cls, KeyedWaitingQueue) else None
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._watermark_blocks = max(1, int(kv.num_blocks * ADMISSION_WATERMARK))
        # Whether one more request may be admitted beyond the watermark (``engine.admission``).
        self.admission = make_admission(admission, kv)
        # When set, it limits the prefill tokens of each step (``engine.chunk_budget``).
        self.chunk_controller = chunk_controller

    def add_request(self, req: Request) -> None:
        self.waiting.push(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = self.running
        if self._running_key is not None:
            running.sort(key=self._running_key)  # the tail is then the first to be preempted
        self.waiting.tick()

        # Prefill tokens (not decodes) may be limited further by the inter-token latency target.
        prefill_left = budget if self.chunk_controller is None else min(budget, self.chunk_controller.budget)
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            spec = self._schedule_lookahead(req, n, budget)
            if spec:
                out.requests.append(req)
                out.num_new_tokens.append(n + spec)
                out.num_spec_tokens[req.request_id] = spec
                budget -= n + spec
                i += 1
                continue
            prefill = is_prefill(req, n)
            if prefill:
                n = min(n, prefill_left)
                if n == 0:
                    i += 1
                    continue
            while not self.kv.allocate_slots(req, n):
                victim = running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_new_tokens.append(n)
                budget -= n
                if prefill:
                    prefill_left -= n
                i += 1
                continue
            break

        if out.num_preempted == 0:
            self._admit(out, min(budget, prefill_left))
        return out

    def _schedule_lookahead(self, req: Request, n: int, budget: int) -> int:
        """Speculative decoding: the proposed tokens (up to ``req.num_lookahead_tokens``) that
        this decode also computes, with their slots allocated; 0 when none are wanted, or when
        the budget or the free blocks are short (speculate less rather than preempt)."""
        if not req.num_lookahead_tokens or n != 1:
            return 0
        spec = min(req.num_lookahead_tokens, budget - n)
        while spec > 0 and not self.kv.allocate_slots(req, n + spec):
            spec //= 2
        return spec

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        now = time.monotonic()
        if (
            isinstance(self.waiting, (PrefixAwareWaitingQueue, SRPFWaitingQueue))
            and len(self.waiting) > 1
            and (len(self.running) < self.max_num_seqs and budget > 0)
        ):
            self.waiting.reorder(self.kv)
        if len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            # (a full batch, the usual state of a busy batch worker, admits nobody: no prediction)
            self.admission.start(self.running)
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            hits, num_cached = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_cached
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if not self.admission.admits(req, num_cached):
                break
            reserve = self._watermark_blocks if self.running else 0
            if not self.kv.allocate_slots(req, n, hits, reserve_blocks=reserve):
                break
            self.admission.admitted(req)
            self.waiting.pop()
            req.num_computed_tokens = num_cached
            if req.status is RequestStatus.WAITING:  # first admission, not a re-admission
                req.num_cached_tokens = num_cached
                req.metrics.num_cached_tokens = num_cached
                req.metrics.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    # ---------------------------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` wherever it is (running or waiting) and free its blocks."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)

    def record_finished(self, req: Request) -> None:
        """``req`` has its last token: its output length teaches the admission policy."""
        self.admission.finished(req)

    def drop_finished_running(self) -> None:
        """Free the blocks of running requests that finished in the last step."""
        still = []
        for req in self.running:
            if req.finished:
                self.kv.free(req)
            else:
                still.append(req)
        self.running = still
