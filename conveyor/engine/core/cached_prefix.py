"""The scheduler's rule for the prefix cache: which of a waiting request's tokens it may take
from the cache instead of computing them. The cache (``RequestMemory.get_computed_blocks``) only
says what it holds; whether a request may use it is the scheduler's call, asked here by
admission and by the waiting queues that order by cached prefix."""

from __future__ import annotations

from typing import Any

from conveyor.engine.core.request import Request
from conveyor.engine.memory.request_memory import RequestMemory


def reusable_prefix(kv: RequestMemory, req: Request) -> tuple[list[Any], int]:
    """The cached prefix ``req`` may reuse: ``kv``'s handles for it and the tokens they cover.

    None for a request still owed prompt logprobs, or pooling more than its last token: it
    computes its whole prompt, since a cached token has no logits or hidden states."""
    if req.needs_every_prompt_row:
        return [], 0
    return kv.get_computed_blocks(req)
