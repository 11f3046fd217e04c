"""The scheduler's part of speculative decoding: the proposed tokens a decode may compute."""

from __future__ import annotations

from conveyor.engine.core.request import Request
from conveyor.engine.memory.request_memory import RequestMemory


def grant_lookahead(kv: RequestMemory, req: Request, n: int, budget: int) -> int:
    """The proposed tokens (up to ``req.num_lookahead_tokens``, which only speculative decoding
    sets) that this decode of ``n`` tokens also computes, with their slots allocated; 0 when
    none are wanted, or when the budget or the free blocks are short (speculate less rather
    than preempt)."""
    if not req.num_lookahead_tokens or n != 1:
        return 0
    k = min(req.num_lookahead_tokens, budget - n)
    while k > 0 and not kv.allocate_slots(req, n + k):
        k //= 2
    return k
