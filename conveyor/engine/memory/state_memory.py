"""``HybridMemory``: the ``RequestMemory`` of a hybrid model (Qwen3.5): the paged K/V of its
full-attention layers, and one state slot per running request for its linear-attention layers
(``conveyor.engine.memory.state_cache``).

A slot is taken when a request is first given room (its admission, or re-admission after a
preemption) and given back when it finishes, is aborted or is preempted; a preempted request is
recomputed from its first token, its state from zero, as its K/V is. Admission waits when no
slot is free, like it does when blocks are short. The runner reserves ``max_num_seqs`` slots,
so the sequence cap is the binding limit and a running request always has its slot.

Prefix caching is off for hybrid models: a cached prefix would have to restore the recurrent
state as of its last block too, a snapshot per cached block (see docs/engine/models.md for the
sizes), and a request's first block must be its own, since it names the request's slot.

Speculative decoding: a verification step runs a request's decode and proposals through its
state, so a rejection must take the state back too: ``trim`` gives the slot the snapshot the
step left after the last kept token (``LinearStateCache.rollback``), as it frees the K/V blocks
only the rejected tokens held.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from conveyor.engine.core.request import Request
from conveyor.engine.memory.kv_cache import KVBlock, KVCacheManager
from conveyor.engine.memory.state_cache import LinearStateCache

log = logging.getLogger(__name__)


@dataclass
class HybridMemory(KVCacheManager):
    state: LinearStateCache | None = None
    _free_slots: list[int] = field(init=False, default_factory=list)
    _slot_of: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.state is None:
            raise ValueError("HybridMemory needs the model's state slots")
        if self.enable_caching:
            raise ValueError("prefix caching is not served for hybrid models")
        self._free_slots = list(range(self.state.num_slots - 1, -1, -1))

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    def state_slot(self, seq_id: str) -> int | None:
        return self._slot_of.get(seq_id)

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        reserve_blocks: int = 0,
    ) -> bool:
        new = req.seq_id not in self._slot_of
        if new and not self._free_slots:
            return False
        if not super().allocate_slots(req, num_new_tokens, computed_blocks, reserve_blocks):
            return False
        if new:
            assert self.state is not None
            slot = self._free_slots.pop()
            self._slot_of[req.seq_id] = slot
            self.state.bind(self.block_ids(req.seq_id)[0], slot)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        super().trim(req, num_tokens)
        slot = self._slot_of.get(req.seq_id)
        if slot is not None:
            assert self.state is not None
            self.state.rollback(slot, num_tokens)

    def free(self, req: Request) -> None:
        slot = self._slot_of.pop(req.seq_id, None)
        if slot is not None:
            assert self.state is not None
            self.state.bind(self.block_ids(req.seq_id)[0], -1)
            self._free_slots.append(slot)
        super().free(req)


def make_request_memory(
    state: LinearStateCache | None, *, speculative: bool, enable_caching: bool, **kv_kwargs
) -> KVCacheManager:
    """The paged K/V manager, or ``HybridMemory`` for a model with per-request state (prefix
    caching then off, with the reason logged; with speculative decoding, the state must keep the
    snapshots a rollback takes)."""
    if state is None:
        return KVCacheManager(enable_caching=enable_caching, **kv_kwargs)
    if speculative and not state.num_snapshots:
        raise ValueError(
            "speculative decoding on a hybrid (linear-attention) model needs state snapshots to roll back "
            "rejected proposals: allocate the state with num_snapshots = num_speculative_tokens"
        )
    if enable_caching:
        log.info("prefix caching is off for this hybrid model: its recurrent state is per request, not per block")
    return HybridMemory(enable_caching=False, state=state, **kv_kwargs)
