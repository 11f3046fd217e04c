"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's logprob under the
model's distribution at the position before it, and the top alternatives there.

A prefill chunk's hidden state at position ``p`` gives the distribution of token ``p + 1``, so
a chunk over positions ``[start, start + n)`` yields the entries of prompt tokens ``start + 1``
to ``start + n`` (none past the prompt: the last prompt position's row is the one sampled).
Entries already computed are not computed again when a preempted request recomputes its
prompt. The logits are taken in slices of rows, so a long chunk never holds a whole
``chunk x vocabulary`` tensor at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.engine.core.request import Request
from conveyor.engine.core.step_result import StepResult
from conveyor.engine.runner.batch import LogitsOf, RowPlan

PromptEntries = list[dict[int, float] | None]

# Rows whose logits are computed at once.
ROWS_PER_SLICE = 256


@dataclass
class PromptLogprobRows:
    req: Request
    rows: list[int]  # rows of the step's hidden states, in batch order
    targets: list[int]  # the prompt token each row's distribution is asked about


def rows_for(req: Request, start: int, num_new: int, first_row: int) -> PromptLogprobRows | None:
    """The rows of ``req``'s chunk (positions ``start``.. at batch rows ``first_row``..) that
    give prompt logprobs still missing; None when there are none."""
    if not req.num_prompt_logprobs_missing:
        return None
    assert req.prompt_logprobs is not None
    next_position = len(req.prompt_logprobs) - 1  # its row gives the next missing entry
    if start > next_position:
        raise RuntimeError(
            f"request {req.request_id!r}: prompt logprobs from position {next_position} on are missing, "
            f"but its chunk starts at {start} (were prompt tokens taken from the prefix cache?)"
        )
    end = min(start + num_new, req.num_prompt_tokens - 1)
    if next_position >= end:
        return None
    rows = list(range(first_row + next_position - start, first_row + end - start))
    return PromptLogprobRows(req, rows, req.prompt_token_ids[next_position + 1 : end + 1])


def compute(
    plans: list[PromptLogprobRows], logits_of: Callable[[list[int]], torch.Tensor]
) -> list[tuple[Request, PromptEntries]]:
    """Each request's new entries; ``logits_of(rows)`` gives the logits of those rows."""
    out: list[tuple[Request, PromptEntries]] = []
    for plan in plans:
        k = plan.req.params.prompt_logprobs or 0
        entries: PromptEntries = []
        for lo in range(0, len(plan.rows), ROWS_PER_SLICE):
            rows, targets = plan.rows[lo : lo + ROWS_PER_SLICE], plan.targets[lo : lo + ROWS_PER_SLICE]
            logprobs = torch.log_softmax(logits_of(rows).float(), dim=-1)
            target_t = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
            chosen = logprobs.gather(1, target_t).squeeze(1).tolist()
            top_ids: list[list[int]] = [[] for _ in rows]
            top_vals: list[list[float]] = [[] for _ in rows]
            if k:
                top = logprobs.topk(k, dim=-1)
                top_vals, top_ids = top.values.tolist(), top.indices.tolist()
            for target, lp, ids, vals in zip(targets, chosen, top_ids, top_vals, strict=True):
                entry = {target: lp}
                for t, v in zip(ids, vals, strict=True):
                    entry.setdefault(t, v)
                entries.append(entry)
        out.append((plan.req, entries))
    return out


class PromptLogprobsHook:
    """The batch builder's ``RowHook`` for prompt logprobs: the rows of each chunk that give
    entries still missing; it appends their entries to the request's ``prompt_logprobs``
    (output state of this add-on's own, never read for scheduling)."""

    def plan(self, reqs: list[Request], num_new: list[int], first_rows: list[int]) -> list[RowPlan]:
        plans = []
        for req, n, first in zip(reqs, num_new, first_rows, strict=True):
            if req.prompt_logprobs is not None and (rows := rows_for(req, req.num_computed_tokens, n, first)):
                plans.append(RowPlan(req, rows.rows, rows))
        return plans

    def collect(self, plans: list[RowPlan], logits_of: LogitsOf, result: StepResult) -> None:
        for req, entries in compute([p.data for p in plans], logits_of):
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.extend(entries)
