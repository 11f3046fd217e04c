"""The prefill token budget per step, adapted online to an inter-token latency target.

A step that carries decodes is an inter-token interval for every request decoding in it; a
long prefill chunk in the same step stretches it. With ``EngineConfig.target_itl_ms`` set,
the engine reports each step's duration here and the scheduler limits the prefill tokens
(chunks of new or resumed prompts; decodes are never limited) of the next step to
``PrefillChunkController.budget``. Every ``min_samples`` steps with decodes, the p90 of
their durations is compared with the target: above it, the budget shrinks by
``SHRINK``; below ``HEADROOM`` of it, it grows by ``GROW``; within, it stays. The durations
are then forgotten, so the next decision only sees steps run under the new budget. The
budget stays between ``floor`` (prompts keep moving however slow the steps are) and
``ceiling`` (``max_num_batched_tokens``).
"""

from __future__ import annotations

import math

from engine.request import Request

SHRINK = 0.7
GROW = 1.25
HEADROOM = 0.8
# Steps with decodes measured before each decision.
CHUNK_BUDGET_MIN_SAMPLES = 8
# The smallest budget: a prompt always moves at least this many tokens a step.
MIN_PREFILL_BUDGET = 32


class PrefillChunkController:
    def __init__(self, target_s: float, floor: int, ceiling: int, min_samples: int = CHUNK_BUDGET_MIN_SAMPLES) -> None:
        if not (math.isfinite(target_s) and target_s > 0):
            raise ValueError(f"the inter-token latency target must be a positive number of seconds, got {target_s!r}")
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got floor {floor} and ceiling {ceiling}")
        self.target_s = target_s
        self.floor = floor
        self.ceiling = ceiling
        self.min_samples = min_samples
        self.budget = ceiling
        self._durations: list[float] = []
        self.num_shrinks = 0
        self.num_grows = 0

    def observe(self, duration_s: float, had_decodes: bool) -> None:
        """A step took ``duration_s`` seconds; ``had_decodes``: it generated a token for a
        request past its prefill (only those steps are inter-token intervals)."""
        if not had_decodes:
            return
        self._durations.append(duration_s)
        if len(self._durations) < self.min_samples:
            return
        p90 = self.p90()
        self._durations.clear()
        if p90 > self.target_s and self.budget > self.floor:
            self.budget = max(self.floor, int(self.budget * SHRINK))
            self.num_shrinks += 1
        elif p90 < HEADROOM * self.target_s and self.budget < self.ceiling:
            self.budget = min(self.ceiling, max(self.budget + 1, int(self.budget * GROW)))
            self.num_grows += 1

    def p90(self) -> float:
        d = sorted(self._durations)
        return d[math.ceil(0.9 * len(d)) - 1]


def is_prefill(req: Request, num_new_tokens: int) -> bool:
    """Whether ``num_new_tokens`` for ``req`` are prompt (or recomputed) tokens, not a decode."""
    return not (num_new_tokens == 1 and req.output_token_ids and req.num_computed_tokens + 1 == req.num_tokens)


def make_chunk_controller(
    target_itl_ms: float | None, block_size: int, max_num_batched_tokens: int
) -> PrefillChunkController | None:
    if target_itl_ms is None:
        return None
    floor = min(max_num_batched_tokens, max(MIN_PREFILL_BUDGET, block_size))
    return PrefillChunkController(target_itl_ms / 1000.0, floor, max_num_batched_tokens)
