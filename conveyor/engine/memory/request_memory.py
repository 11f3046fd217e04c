"""The seam for what a request holds in device memory: how it is allocated as the request
grows, released while it runs, freed when it finishes or is preempted, and counted in the
memory budget. The scheduler (and admission, and the waiting queues) only talk to this.

``KVCacheManager`` (paged K/V with prefix caching) is the one implementation today. A second
kind of per-request cache (a hybrid model's recurrent state, a quantized or latent K/V layout)
is a new implementation, or one that composes the paged K/V with its own state, not new
branches in the scheduler: it answers the same calls for the same requests.

Budget units are blocks: ``num_blocks`` in all, ``num_free_blocks`` of them free; an
implementation whose state is per request rather than per token counts it in the same units.
"""

from __future__ import annotations

from typing import Any, Protocol

from conveyor.engine.core.request import Request


class RequestMemory(Protocol):
    # The budget: units (blocks) in all, and the tokens one unit holds.
    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    def get_computed_blocks(self, req: Request) -> tuple[list[Any], int]:
        """What a waiting request can reuse (a cached prefix): opaque handles for
        ``allocate_slots``, and the tokens they cover."""
        ...

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[Any] | None = None, reserve_blocks: int = 0
    ) -> bool:
        """Room for ``num_new_tokens`` more tokens of ``req`` (after ``computed_blocks`` on
        admission); False, with nothing changed, when the budget (less ``reserve_blocks``) is short."""
        ...

    def block_ids(self, seq_id: str) -> list[int]:
        """Where the request's tokens live on the device (its block table), for the runner."""
        ...

    def release_unreachable(self, reqs: list[Request], num_uncertain: dict[str, int]) -> None:
        """A step advanced ``reqs``' computed tokens, the last ``num_uncertain[seq_id]`` of a
        request's possibly rolled back: release what no later token can read (a sliding
        window's old blocks)."""
        ...

    def trim(self, req: Request, num_tokens: int) -> None:
        """``req`` was rolled back to ``num_tokens`` tokens: free what only the rest held."""
        ...

    def free(self, req: Request) -> None:
        """``req`` finished or was preempted: everything it holds goes back."""
        ...
