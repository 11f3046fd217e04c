"""Speculative decoding's part of each engine step: what each running decode may propose
(before scheduling), the proposals themselves (after it), their verification and stats.

The step: ``plan`` sets ``num_lookahead_tokens`` on each running request that may speculate
(a decode, its prompt done, no grammar, room left under ``max_tokens``); the scheduler grants
what the token budget and the free blocks allow (``SchedulerOutput.num_spec_tokens``);
``propose`` fills ``spec_token_ids`` for the granted ones; the target computes ``1 + k``
positions for each; ``verify`` decides, and the scheduler's update rolls back the rejected ones
(``num_computed_tokens`` lowered, the blocks left empty freed) and appends the rest.

Requests with structured outputs are not speculated: the grammar would have to be advanced
over proposals and rolled back, and their constrained outputs gain little from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from conveyor.engine.core.request import Request, RequestStatus
from conveyor.engine.core.scheduler_output import SchedulerOutput
from conveyor.engine.core.step_result import NewTokens, StepResult
from conveyor.engine.runner.batch import LogitsOf, RowPlan
from conveyor.engine.sample.sampler import Sampler
from conveyor.engine.spec_decode.config import SpeculativeConfig
from conveyor.engine.spec_decode.draft import DraftModel
from conveyor.engine.spec_decode.ngram import ngram_proposal
from conveyor.engine.spec_decode.stats import SpecDecodeStats
from conveyor.engine.spec_decode.verifier import Verdict, verify

if TYPE_CHECKING:
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.models.model_config import ModelSpec
    from conveyor.engine.runner.model_runner import ModelRunner
    from conveyor.engine.spec_decode.stats import SpecDecodeStats as StatsSnapshot


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
                self._ngram[req.seq_id] = proposal
                k = len(proposal)
            req.num_lookahead_tokens = k

    def propose(self, sched: SchedulerOutput, running: list[Request]) -> None:
        granted = [r for r in sched.requests if sched.num_spec_tokens.get(r.seq_id)]
        if self.draft is not None:
            self.draft.keep_only(running)
            counts = {r.seq_id: sched.num_spec_tokens[r.seq_id] for r in granted}
            own = [
                n - sched.num_spec_tokens.get(r.seq_id, 0)
                for r, n in zip(sched.requests, sched.num_new_tokens, strict=True)
            ]
            self.draft.propose(sched.requests, own, counts, sched.block_tables)
        else:
            for req in granted:
                req.spec_token_ids = self._ngram[req.seq_id][: sched.num_spec_tokens[req.seq_id]]
        self._ngram.clear()

    def stats_snapshot(self) -> StatsSnapshot | None:
        return self.stats.snapshot()

    def block_bytes(self, block_size: int) -> int:
        """What the draft model's K/V takes per block of the target's (indexed by the same ids)."""
        return self.draft.block_bytes(block_size) if self.draft is not None else 0

    def attach(self, runner: ModelRunner) -> None:
        """Give the draft its K/V for the target's blocks, and verify in the target's steps."""
        if self.draft is not None:
            self.draft.allocate_kv(runner.num_blocks, runner.block_size)
        runner.row_hooks.append(VerificationRows(self, runner.sampler))

    def verify(self, sampler: Sampler, logits: torch.Tensor, reqs: list[Request]) -> list[Verdict]:
        """The verdict on each request's proposals; the scheduler rolls the rejected ones back."""
        verdicts = verify(sampler, logits, reqs)
        for req, verdict in zip(reqs, verdicts, strict=True):
            k = len(req.spec_token_ids)
            if self.draft is not None:
                self.draft.accepted(req, verdict.num_accepted, k)
            req.spec_token_ids = []
            self.stats.record(k, verdict.num_accepted)
            req.metrics.num_spec_proposed_tokens += k
            req.metrics.num_spec_accepted_tokens += verdict.num_accepted
            verdict.num_rejected = k - verdict.num_accepted
        return verdicts


class VerificationRows:
    """The batch builder's ``RowHook`` for speculative decoding: a decode computed with its
    proposals is verified at its ``1 + k`` last rows instead of sampled; the verdicts go to
    ``StepResult.new_tokens``, with the rejected proposals counted for the scheduler."""

    def __init__(self, speculator: Speculator, sampler: Sampler) -> None:
        self.speculator = speculator
        self.sampler = sampler

    def plan(self, reqs: list[Request], num_new: list[int], first_rows: list[int]) -> list[RowPlan]:
        plans = []
        for req, n, first in zip(reqs, num_new, first_rows, strict=True):
            k = len(req.spec_token_ids)
            if k and req.num_computed_tokens + n == req.num_tokens + k:
                plans.append(RowPlan(req, list(range(first + n - 1 - k, first + n))))
        return plans

    def collect(self, plans: list[RowPlan], logits_of: LogitsOf, result: StepResult) -> None:
        reqs = [p.req for p in plans]
        logits = logits_of([r for p in plans for r in p.rows])
        for req, verdict in zip(reqs, self.speculator.verify(self.sampler, logits, reqs), strict=True):
            result.new_tokens.append(NewTokens(req, verdict.token_ids, verdict.logprobs, verdict.num_rejected))


class NoSpeculation:
    """Speculative decoding off: nothing is planned, proposed or verified."""

    draft: DraftModel | None = None

    def plan(self, running: list[Request]) -> None:
        pass

    def propose(self, sched: SchedulerOutput, running: list[Request]) -> None:
        pass

    def stats_snapshot(self) -> StatsSnapshot | None:
        return None

    def block_bytes(self, block_size: int) -> int:
        return 0

    def attach(self, runner: ModelRunner) -> None:
        pass


def load_speculator(
    config: EngineConfig, target_spec: ModelSpec, tokenizer: Any, max_model_len: int
) -> Speculator | NoSpeculation:
    """The engine's speculator (with its draft model loaded, for ``method="draft"``), or none."""
    if config.speculative is None:
        return NoSpeculation()
    spec_config = SpeculativeConfig.from_value(config.speculative)
    draft = None
    if spec_config.method == "draft":
        device = config.resolve_device()
        draft = DraftModel(
            spec_config,
            target_spec,
            tokenizer,
            attention_backend=config.model.attention_backend,
            max_model_len=max_model_len,
            dtype=config.resolve_dtype(target_spec.checkpoint_dtype, device),
            device=device,
        )
    return Speculator(spec_config, draft)
