"""The batch builder: a scheduled step as flat, unpadded host lists (token ids, positions,
KV slots, per-request lengths and block tables) and the rows whose logits are wanted.

Requests with a single query token (decodes) come first, by context length (the torch
backend buckets them by it), then prefill chunks. A request whose chunk ends at its last
token is sampled at its last row. Add-ons that want the logits of more rows (prompt logprobs,
speculative decoding's verification) plug in as ``RowHook``s: the builder asks each about
the step's chunks, and the runner hands them those rows' logits after sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler_output import SchedulerOutput
from conveyor.engine.core.step_result import StepResult

LogitsOf = Callable[[list[int]], torch.Tensor]


class StepRows:
    """A step's final hidden states: ``rows(ids)`` their logits, ``hidden(ids)`` the states
    themselves (what pooling reads). Executors that keep no hidden states (tensor
    parallelism's gathered logits) hand back a plain ``LogitsOf``."""

    def __init__(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._hidden = hidden
        self._compute_logits = compute_logits

    def hidden(self, rows: list[int]) -> torch.Tensor:
        h = self._hidden
        # Every row (always so for decodes), or a subset.
        return h if len(rows) == h.shape[0] else h[torch.tensor(rows, device=h.device)]

    def __call__(self, rows: list[int]) -> torch.Tensor:
        return self._compute_logits(self.hidden(rows))


@dataclass
class RowPlan:
    """The rows of one request's chunk a hook wants, with what it needs to use them."""

    req: Request
    rows: list[int]
    data: Any = None


class RowHook(Protocol):
    def plan(self, reqs: list[Request], num_new: list[int], first_rows: list[int]) -> list[RowPlan]:
        """The rows it wants of the step's chunks: request ``reqs[i]``'s positions from
        ``num_computed_tokens`` on, ``num_new[i]`` of them, at batch rows ``first_rows[i]``.."""
        ...

    def collect(self, plans: list[RowPlan], logits_of: LogitsOf, result: StepResult) -> None:
        """This step's plans (at least one), with ``logits_of(rows)``; writes into ``result``."""
        ...


@dataclass
class Batch:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    tables: list[list[int]]
    num_decodes: int
    sampled: list[Request]  # requests whose next token is sampled, in batch order
    sample_rows: list[int]  # ... at these rows
    plans: list[list[RowPlan]] = field(default_factory=list)  # per hook, its requests' rows

    @property
    def wanted_rows(self) -> list[int]:
        """Every row whose logits are needed, in batch order."""
        extra = [r for plans in self.plans for p in plans for r in p.rows]
        return sorted(self.sample_rows + extra) if extra else self.sample_rows


def build_batch(sched: SchedulerOutput, block_size: int, hooks: Sequence[RowHook]) -> Batch:
    order = sorted(
        range(len(sched.requests)),
        key=lambda i: (sched.num_new_tokens[i] != 1, sched.requests[i].num_computed_tokens),
    )
    reqs = [sched.requests[i] for i in order]
    counts = [sched.num_new_tokens[i] for i in order]
    tables = [sched.block_tables[i] for i in order]
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    sampled: list[Request] = []
    first_rows: list[int] = []
    end = 0
    for req, n, table in zip(reqs, counts, tables, strict=True):
        start = req.num_computed_tokens
        first_rows.append(end)
        if n == 1:  # a decode: plain ints beat numpy for one token
            input_ids.append(req.token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            input_ids.extend(req.scheduled_token_ids(start, n))
            pos = np.arange(start, start + n, dtype=np.int64)
            positions.extend(pos.tolist())
            slots.extend((np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
        seq_lens.append(start + n)
        end += n
        if start + n == req.num_tokens:
            sample_rows.append(end - 1)
            sampled.append(req)
    num_decodes = sum(1 for n in counts if n == 1)
    plans = [hook.plan(reqs, counts, first_rows) for hook in hooks]
    return Batch(input_ids, positions, slots, seq_lens, counts, tables, num_decodes, sampled, sample_rows, plans)
