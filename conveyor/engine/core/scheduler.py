"""Iteration-level scheduling under a token budget, a sequence cap and the free KV blocks.

Each step: running requests first (a decode token each, or the next chunk of an unfinished
prefill), then waiting requests admitted by policy while the budget, the cap and the free
blocks allow. When a running request cannot get a block, the request at the tail of the
running list (the newest; under ``priority`` and ``edf`` the last in the policy's order) is
preempted: its blocks are freed and it goes back to the queue (to its front under ``fcfs``,
``prefix`` and ``srpf``), to be recomputed later. Whether a waiting request may be admitted
beyond the free blocks is ``conveyor.engine.core.admission``'s call; with an inter-token latency target, the
prefill tokens of a step (never its decodes) are limited by ``conveyor.engine.core.chunk_budget``.

The waiting queue's order is the scheduling policy's (``conveyor.engine.core.waiting_queues``).

After the step runs, ``update_from_output`` is the one place that moves requests on: it
advances their computed tokens, appends what they produced (rolling back rejected
proposals), applies stops, releases what they no longer need, finishes and frees them, and
tells the prefill chunk budget how long the step took.

Requests sharing a prefix never compute it twice: a request's full blocks are registered in
the prefix cache when they are scheduled, and a request is only admitted once every running
prefill has been scheduled to its end (an unfinished one takes all the budget left), so a
newcomer always finds the shared blocks of the requests before it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.engine.core.admission import make_admission
from conveyor.engine.core.cached_prefix import reusable_prefix
from conveyor.engine.core.chunk_budget import PrefillChunkController, UnlimitedPrefill, is_prefill
from conveyor.engine.core.request import Request, RequestStatus
from conveyor.engine.core.scheduler_output import SchedulerOutput
from conveyor.engine.core.step_result import StepResult
from conveyor.engine.core.waiting_queues import SRPF_AGING_STEPS, WaitingQueue, make_waiting_queue
from conveyor.engine.memory.request_memory import RequestMemory
from conveyor.engine.spec_decode.lookahead import grant_lookahead

log = logging.getLogger(__name__)

# New requests are admitted only while this share of blocks stays free for running ones to
# grow into; without it a full admission makes the very next decode step preempt.
ADMISSION_WATERMARK = 0.01


@dataclass
class StepCounters:
    """What the steps so far did, for ``LLMEngine.stats``."""

    num_steps: int = 0
    last_step_tokens: int = 0
    total_step_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        kv: RequestMemory,
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
        self.policy = policy
        self.waiting: WaitingQueue = make_waiting_queue(policy, kv, srpf_aging_steps)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.counters = StepCounters()
        self._watermark_blocks = max(1, int(kv.num_blocks * ADMISSION_WATERMARK))
        # Whether one more request may be admitted beyond the watermark (``conveyor.engine.core.admission``).
        self.admission = make_admission(admission, kv)
        # When set, it limits the prefill tokens of each step (``conveyor.engine.core.chunk_budget``).
        self.chunk_controller = chunk_controller
        self._prefill_budget = chunk_controller or UnlimitedPrefill(max_num_batched_tokens)

    def add_request(self, req: Request) -> None:
        self.waiting.push(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = self.running
        self.waiting.order_running(running)  # the tail is then the first to be preempted
        self.waiting.tick()

        # Prefill tokens (not decodes) may be limited further by the inter-token latency target.
        prefill_left = min(budget, self._prefill_budget.budget)
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            lookahead = grant_lookahead(self.kv, req, n, budget)  # speculative decoding's proposals
            if lookahead:
                out.requests.append(req)
                out.num_new_tokens.append(n + lookahead)
                out.num_spec_tokens[req.seq_id] = lookahead
                budget -= n + lookahead
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
        out.block_tables = [self.kv.block_ids(r.seq_id) for r in out.requests]
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        now = time.monotonic()
        if len(self.waiting) > 1 and len(self.running) < self.max_num_seqs and budget > 0:
            self.waiting.reorder(self.kv)
        if len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            # (a full batch, the usual state of a busy batch worker, admits nobody: no prediction)
            self.admission.start(self.running)
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            hits, num_cached = reusable_prefix(self.kv, req)
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
    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply an executed step: the scheduled tokens are computed, each request's new tokens
        appended (its rejected proposals rolled back first) up to the first that finishes it,
        what requests no longer need released, and the finished ones freed. Returns them."""
        self._prefill_budget.observe_step(out, result.duration_s)  # reads the tokens before they advance
        counters = self.counters
        for req, n in zip(out.requests, out.num_new_tokens, strict=True):
            if req.num_computed_tokens < req.num_prompt_tokens:
                counters.num_prompt_tokens_computed += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
        self.kv.release_unreachable(out.requests, out.num_spec_tokens)
        now = time.monotonic()
        finished: list[Request] = []
        logprobs = result.sampled_logprobs
        for i, (req, token) in enumerate(zip(result.sampled, result.sampled_token_ids, strict=True)):
            status = self._append(req, (token,), (logprobs[i],) if logprobs else None, now)
            if status is not None:
                self._finished(req, status, now, finished)
        for new in result.new_tokens:
            req = new.req
            req.num_computed_tokens -= new.num_rejected  # the rejected proposals' K/V is stale
            status = self._append(req, new.token_ids, new.logprobs, now)
            if status is not None:
                self._finished(req, status, now, finished)
            elif new.num_rejected:
                self.kv.trim(req, req.num_computed_tokens)  # blocks only the rejected ones held
        if finished:
            self._free_finished_running()
        counters.num_steps += 1
        counters.last_step_tokens = out.total_tokens
        counters.total_step_tokens += out.total_tokens
        return finished

    def _append(
        self, req: Request, token_ids: Sequence[int], logprobs: Sequence[dict[int, float] | None] | None, now: float
    ) -> RequestStatus | None:
        """Append the tokens up to the first that finishes the request (the rest are dropped);
        the finished state, if any. One request's failure must not sink the batch: it
        finishes with an error."""
        try:
            for i, token in enumerate(token_ids):
                self.counters.num_generated_tokens += 1
                status = req.append_output(token, logprobs[i] if logprobs else None, now)
                if status is not None:
                    return status
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            req.error = f"{type(exc).__name__}: {exc}"
            return RequestStatus.FINISHED_ERROR
        return None

    def _finished(self, req: Request, status: RequestStatus, now: float, finished: list[Request]) -> None:
        req.status = status
        req.metrics.finished_time = now
        self.admission.finished(req)
        finished.append(req)

    def _free_finished_running(self) -> None:
        still = []
        for req in self.running:
            if req.finished:
                self.kv.free(req)
            else:
                still.append(req)
        self.running = still

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` from outside a step (an abort) wherever it is, running or waiting, and
        free what it holds."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
