"""A hybrid model's per-request state: for each linear-attention layer, the conv's last inputs
and the recurrent state, in fixed-size slots (one per running request), beside the paged KV
cache of its full-attention layers.

The runner allocates the slots (``allocate``) with the KV cache, out of the same memory budget;
``engine.state_memory.HybridMemory`` hands them to requests. A request's slot is found on the
device from its first KV block (``slot_of_block``), which no other running request shares
(prefix caching is off for hybrid models), so the step's batch needs no new field: the model
reads the slots from the block tables its attention backend already has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.hybrid_config import LinearAttentionSpec


@dataclass
class LinearStateCache:
    # One slot more than requests can hold: the padding rows of a captured decode graph (no
    # request, stale block tables) read and write that one, never a request's.
    conv: list[torch.Tensor]  # per linear layer: [num_slots + 1, conv_dim, conv_kernel - 1], model dtype
    recurrent: list[torch.Tensor]  # per linear layer: [num_slots + 1, v heads, dk, dv], float32
    # The slot of the request whose first KV block each block is (-1: none).
    slot_of_block: torch.Tensor  # [num_kv_blocks] int64
    num_slots: int

    @property
    def padding_slot(self) -> int:
        return self.num_slots

    @classmethod
    def allocate(
        cls, spec: LinearAttentionSpec, num_slots: int, num_blocks: int, dtype: torch.dtype, device: torch.device
    ) -> LinearStateCache:
        conv_shape = (num_slots + 1, spec.conv_dim, spec.conv_kernel - 1)
        rec_shape = (num_slots + 1, spec.num_v_heads, spec.k_head_dim, spec.v_head_dim)
        layers = range(spec.num_linear_layers)
        return cls(
            conv=[torch.zeros(conv_shape, dtype=dtype, device=device) for _ in layers],
            recurrent=[torch.zeros(rec_shape, dtype=torch.float32, device=device) for _ in layers],
            slot_of_block=torch.full((num_blocks,), -1, dtype=torch.long, device=device),
            num_slots=num_slots,
        )

    def bind(self, first_block: int, slot: int) -> None:
        """A request whose first KV block is ``first_block`` holds ``slot`` (-1: released)."""
        self.slot_of_block[first_block] = slot

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.recurrent))


# What the runner asks of any model; a model without per-request state answers with the
# defaults (every layer on the KV cache, no state).
def state_bytes_per_seq(model: object) -> int:
    """The bytes of one request's state slot (0: the model keeps none)."""
    size = getattr(model, "state_bytes_per_seq", None)
    return int(size()) if callable(size) else 0


def allocate_state(model: object, num_slots: int, num_blocks: int) -> LinearStateCache | None:
    """The model's state slots, ``num_slots`` of them, for a KV cache of ``num_blocks``; None
    for a model without per-request state."""
    allocate = getattr(model, "allocate_state", None)
    return allocate(num_slots, num_blocks) if callable(allocate) else None
