"""What the scheduler plans for one step: which requests compute how many tokens, where
their tokens live, and how many of those tokens are proposals to verify."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.core.request import Request


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Each scheduled request's block table (where its tokens live), in the same order.
    block_tables: list[list[int]] = field(default_factory=list)
    num_preempted: int = 0
    # Speculative decoding: seq id -> proposed tokens scheduled after its decode token
    # (counted in its ``num_new_tokens``); requests not speculated this step are absent.
    num_spec_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)
