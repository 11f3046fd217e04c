"""The prefill token budget per step, adapted online to an inter-token latency target.

A step that carries decodes is an inter-token interval for every request decoding in it; a
long prefill chunk in the same step stretches it. With ``EngineConfig.target_itl_ms`` set,
the engine reports each step's duration here and the scheduler limits the prefill tokens
(chunks of new or resumed prompts; decodes are never limited) of the next step to
``PrefillChunkController.budget``.

Only steps with both decodes and prefill tokens are measured: the budget decides how long
they take, and nothing else (a decode-only step says nothing about the chunk size; were it
counted, the quiet stretches between bursts of prompts would grow the budget back every
time). Each window of ``min_samples`` such steps gives a p90, compared with the target:

- above it, the budget shrinks by the share of the prefill part of that p90 that fits the
  target: a step is roughly its decodes' time ``d`` (the median of recent decode-only steps)
  plus time proportional to its prefill tokens, so the factor is ``(target - d) / (p90 - d)``,
  at least ``SHRINK`` and at most ``MAX_SHRINK`` (one slow outlier cannot collapse it). The
  window need not fill for this: as soon as enough of its steps are over the target that its
  p90 will be over whatever the rest do, it is decided;
- below ``HEADROOM`` of it, the budget grows by ``GROW``; within, it stays.

The window is then forgotten, so the next decision only sees steps run under the new budget.
The budget stays between ``floor`` (prompts keep moving however slow the steps are) and
``ceiling`` (``max_num_batched_tokens``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import TYPE_CHECKING

from conveyor.engine.core.request import Request

if TYPE_CHECKING:
    from conveyor.engine.core.scheduler_output import SchedulerOutput

SHRINK = 0.7
MAX_SHRINK = 0.25
GROW = 1.25
HEADROOM = 0.8
# Steps with decodes and prefill tokens measured before each decision.
CHUNK_BUDGET_MIN_SAMPLES = 20
# The smallest budget: a prompt always moves at least this many tokens a step.
MIN_PREFILL_BUDGET = 32
# Recent decode-only steps whose median is a step's time without prefill.
DECODE_ONLY_SAMPLES = 32


class PrefillChunkController:
    def __init__(self, target_s: float, floor: int, ceiling: int, min_samples: int = CHUNK_BUDGET_MIN_SAMPLES) -> None:
        if not (math.isfinite(target_s) and target_s > 0):
            raise ValueError(f"the inter-token latency target must be a positive number of seconds, got {target_s!r}")
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got floor {floor} and ceiling {ceiling}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be at least 1, got {min_samples}")
        self.target_s = target_s
        self.floor = floor
        self.ceiling = ceiling
        self.min_samples = min_samples
        # The window's p90 is its ``_p90_rank``-th slowest step: once that many are over the
        # target, so is the p90.
        self._p90_rank = min_samples - (math.ceil(0.9 * min_samples) - 1)
        self.budget = ceiling
        self._durations: list[float] = []
        self._decode_only: deque[float] = deque(maxlen=DECODE_ONLY_SAMPLES)
        self.num_shrinks = 0
        self.num_grows = 0

    def observe(self, duration_s: float, had_decodes: bool, had_prefill: bool) -> None:
        """A step took ``duration_s`` seconds; ``had_decodes``: it generated a token for a
        request past its prefill; ``had_prefill``: it computed prompt (or recomputed) tokens."""
        if had_decodes and not had_prefill:
            self._decode_only.append(duration_s)
        if not (had_decodes and had_prefill):
            return
        self._durations.append(duration_s)
        slow = sorted((d for d in self._durations if d > self.target_s), reverse=True)
        if len(slow) >= self._p90_rank:
            p90 = slow[self._p90_rank - 1]
            self._durations.clear()
            if self.budget > self.floor:
                d = statistics.median(self._decode_only) if self._decode_only else 0.0
                fits = (self.target_s - d) / (p90 - d) if self.target_s > d else 0.0
                factor = min(SHRINK, max(MAX_SHRINK, fits))
                self.budget = max(self.floor, int(self.budget * factor))
                self.num_shrinks += 1
            return
        if len(self._durations) < self.min_samples:
            return
        p90 = self.p90()
        self._durations.clear()
        if p90 < HEADROOM * self.target_s and self.budget < self.ceiling:
            self.budget = min(self.ceiling, max(self.budget + 1, int(self.budget * GROW)))
            self.num_grows += 1

    def observe_step(self, out: SchedulerOutput, duration_s: float) -> None:
        """A step that ran ``out`` (its requests' computed tokens not advanced yet) took
        ``duration_s``; a decode verifying proposals is still a decode."""
        num_spec = out.num_spec_tokens
        prefills = [
            is_prefill(req, n - num_spec.get(req.seq_id, 0))
            for req, n in zip(out.requests, out.num_new_tokens, strict=True)
        ]
        self.observe(duration_s, had_decodes=not all(prefills), had_prefill=any(prefills))

    def p90(self) -> float:
        d = sorted(self._durations)
        return d[math.ceil(0.9 * len(d)) - 1]


def is_prefill(req: Request, num_new_tokens: int) -> bool:
    """Whether ``num_new_tokens`` for ``req`` are prompt (or recomputed) tokens, not a decode."""
    return not (num_new_tokens == 1 and req.output_token_ids and req.num_computed_tokens + 1 == req.num_tokens)


class UnlimitedPrefill:
    """No latency target: every step may fill ``max_num_batched_tokens`` with prefill."""

    def __init__(self, ceiling: int) -> None:
        self.budget = ceiling

    def observe_step(self, out: SchedulerOutput, duration_s: float) -> None:
        pass


def make_chunk_controller(
    target_itl_ms: float | None, block_size: int, max_num_batched_tokens: int
) -> PrefillChunkController | None:
    if target_itl_ms is None:
        return None
    floor = min(max_num_batched_tokens, max(MIN_PREFILL_BUDGET, block_size))
    return PrefillChunkController(target_itl_ms / 1000.0, floor, max_num_batched_tokens)
