"""Iteration-level scheduling under a token budget, a sequence cap and the free KV blocks.

Each step: running requests first (a decode token each, or the next chunk of an unfinished
prefill), then waiting requests admitted by policy while the budget, the cap and the free
blocks allow. When a running request cannot get a block, the request at the tail of the
running list (the newest, or the least important under ``priority``) is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed later.

Requests sharing a prefix never compute it twice: a request's full blocks are registered in
the prefix cache when they are scheduled, and a request is only admitted once every running
prefill has been scheduled to its end (an unfinished one takes all the budget left), so a
newcomer always finds the shared blocks of the requests before it.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus

# New requests are admitted only while this share of blocks stays free for running ones to
# grow into; without it a full admission makes the very next decode step preempt.
ADMISSION_WATERMARK = 0.01
# The prefix-aware policy reorders at most this many requests at the head of the queue per
# step, so its cost stays bounded however many thousands are waiting.
PREFIX_POLICY_WINDOW = 128


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

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


class PriorityWaitingQueue(WaitingQueue):
    """Lowest ``priority`` value first, then arrival order (preempted requests keep theirs)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_seq, req))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[2] for e in self._heap)


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
}


def _priority_key(req: Request) -> tuple[int, int]:
    return (req.priority, req.arrival_seq)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        if policy not in WAITING_QUEUES:
            raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {tuple(WAITING_QUEUES)}")
        self.policy = policy
        self.waiting = WAITING_QUEUES[policy]()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._watermark_blocks = max(1, int(kv.num_blocks * ADMISSION_WATERMARK))

    def add_request(self, req: Request) -> None:
        self.waiting.push(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = self.running
        if self.policy == "priority":
            running.sort(key=_priority_key)  # the tail is then the first to be preempted

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
                i += 1
                continue
            break

        if out.num_preempted == 0:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        now = time.monotonic()
        if (
            isinstance(self.waiting, PrefixAwareWaitingQueue)
            and len(self.waiting) > 1
            and (len(self.running) < self.max_num_seqs and budget > 0)
        ):
            self.waiting.reorder(self.kv)
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            hits, num_cached = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_cached
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            reserve = self._watermark_blocks if self.running else 0
            if not self.kv.allocate_slots(req, n, hits, reserve_blocks=reserve):
                break
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

    def drop_finished_running(self) -> None:
        """Free the blocks of running requests that finished in the last step."""
        still = []
        for req in self.running:
            if req.finished:
                self.kv.free(req)
            else:
                still.append(req)
        self.running = still
