"""Speculative decoding's part of each engine step: what each running decode may propose
(before scheduling), the proposals themselves (after it), their verification and stats.

The step: ``plan`` sets ``num_lookahead_tokens`` on each running request that may speculate
(a decode, its prompt done, no grammar, room left under ``max_tokens``); the scheduler grants
what the token budget and the free blocks allow (``SchedulerOutput.num_spec_tokens``);
``propose`` fills ``spec_token_ids`` for the granted ones; the target computes ``1 + k``
positions for each; ``verify`` decides, and the engine rolls back the rejected ones
(``num_computed_tokens`` lowered, the blocks left empty freed) and appends the rest.

Requests with structured outputs are not speculated: the grammar would have to be advanced
over proposals and rolled back, and their constrained outputs gain little from it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.request import Request, RequestStatus
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft import DraftModel
from engine.spec_decode.ngram import ngram_proposal
from engine.spec_decode.stats import SpecDecodeStats
from engine.spec_decode.verifier import Verdict, verify


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        if (config.method == "draft") != (draft is not None):
            raise ValueError("a draft model goes with method='draft', and only with it")
        self.config = config
        self.draft = draft
        self.stats = SpecDecodeStats(config.method, config.num_speculative_tokens)
        self._ngram: dict[str, list[int]] = {}  # prompt-lookup proposals found by ``plan``

    def plan(self, running: list[Request]) -> None:
        cfg = self.config
        self._ngram.clear()
        for req in running:
            req.num_lookahead_tokens = 0
            if (
                req.status is not RequestStatus.RUNNING
                or req.num_computed_tokens != req.num_tokens - 1
                or req.grammar is not None
            ):
                continue
            # The last token a request may still emit is the target's own: never propose past it.
            k = min(cfg.num_speculative_tokens, req.max_total_tokens - req.num_tokens - 1)
            if k < 1:
                continue
            if self.draft is None:
                proposal = ngram_proposal(req.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                if not proposal:
                    continue
                self._ngram[req.request_id] = proposal
                k = len(proposal)
            req.num_lookahead_tokens = k

    def propose(
        self, sched: SchedulerOutput, running: list[Request], block_ids_of: Callable[[Request], list[int]]
    ) -> None:
        granted = [r for r in sched.requests if sched.num_spec_tokens.get(r.request_id)]
        if self.draft is not None:
            self.draft.keep_only(running)
            counts = {r.request_id: sched.num_spec_tokens[r.request_id] for r in granted}
            own = [
                n - sched.num_spec_tokens.get(r.request_id, 0)
                for r, n in zip(sched.requests, sched.num_new_tokens, strict=True)
            ]
            self.draft.propose(sched.requests, own, counts, block_ids_of)
        else:
            for req in granted:
                req.spec_token_ids = self._ngram[req.request_id][: sched.num_spec_tokens[req.request_id]]
        self._ngram.clear()

    def verify(self, sampler: Sampler, logits: torch.Tensor, reqs: list[Request]) -> list[Verdict]:
        verdicts = verify(sampler, logits, reqs)
        for req, verdict in zip(reqs, verdicts, strict=True):
            k = len(req.spec_token_ids)
            # The rejected proposals' K/V is stale: recompute from the first of them (its
            # slot is simply overwritten later).
            req.num_computed_tokens -= k - verdict.num_accepted
            if self.draft is not None:
                self.draft.accepted(req, verdict.num_accepted, k)
            req.spec_token_ids = []
            self.stats.record(k, verdict.num_accepted)
            req.metrics.num_spec_proposed_tokens += k
            req.metrics.num_spec_accepted_tokens += verdict.num_accepted
        return verdicts
