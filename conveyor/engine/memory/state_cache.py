"""A hybrid model's per-request state: for each linear-attention layer, the conv's last inputs
and the recurrent state, in fixed-size slots (one per running request), beside the paged KV
cache of its full-attention layers.

The runner allocates the slots (``allocate``) with the KV cache, out of the same memory budget;
``conveyor.engine.memory.state_memory.HybridMemory`` hands them to requests. A request's slot is found on the
device from its first KV block (``slot_of_block``), which no other running request shares
(prefix caching is off for hybrid models), so the step's batch needs no new field: the model
reads the slots from the block tables its attention backend already has.

With speculative decoding (``num_snapshots`` = its ``num_speculative_tokens``, ``k``), each slot
also keeps ``k`` snapshots of its state, as vLLM and SGLang do: a step that computes at most
``1 + k`` tokens of a request (a verification: the decode and its proposals) leaves the state
after each of its first ``k`` tokens, the one after the token at position ``p`` in snapshot ``p
% k``. When proposals are rejected, the slot takes the snapshot after the last kept token
(``rollback``): exact, and a copy per request instead of a recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.models.hybrid_config import LinearAttentionSpec


@dataclass
class LinearStateCache:
    # One slot more than requests can hold: the padding rows of a captured decode graph (no
    # request, stale block tables) read and write that one, never a request's. Layer ``i``'s
    # tensors are ``conv[i]`` and ``recurrent[i]`` (all layers in one tensor: a rollback is one
    # copy for all of them).
    conv: torch.Tensor  # [linear layers, num_slots + 1, conv_dim, conv_kernel - 1], model dtype
    recurrent: torch.Tensor  # [linear layers, num_slots + 1, v heads, dk, dv], float32
    # The slot of the request whose first KV block each block is (-1: none).
    slot_of_block: torch.Tensor  # [num_kv_blocks] int64
    num_slots: int
    # Speculative decoding's snapshots (None without): [layers, num_slots + 1, num_snapshots, ...].
    conv_snapshots: torch.Tensor | None = None
    recurrent_snapshots: torch.Tensor | None = None

    @property
    def padding_slot(self) -> int:
        return self.num_slots

    @property
    def num_snapshots(self) -> int:
        return 0 if self.recurrent_snapshots is None else self.recurrent_snapshots.shape[2]

    @classmethod
    def allocate(
        cls,
        spec: LinearAttentionSpec,
        num_slots: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        num_snapshots: int = 0,
    ) -> LinearStateCache:
        layers = spec.num_linear_layers
        conv_shape = (spec.conv_dim, spec.conv_kernel - 1)
        rec_shape = (spec.num_v_heads, spec.k_head_dim, spec.v_head_dim)

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        snapshots = (num_slots + 1, num_snapshots)
        return cls(
            conv=zeros(layers, num_slots + 1, *conv_shape, dtype=dtype),
            recurrent=zeros(layers, num_slots + 1, *rec_shape, dtype=torch.float32),
            slot_of_block=torch.full((num_blocks,), -1, dtype=torch.long, device=device),
            num_slots=num_slots,
            conv_snapshots=zeros(layers, *snapshots, *conv_shape, dtype=dtype) if num_snapshots else None,
            recurrent_snapshots=zeros(layers, *snapshots, *rec_shape, dtype=torch.float32) if num_snapshots else None,
        )

    def bind(self, first_block: int, slot: int) -> None:
        """A request whose first KV block is ``first_block`` holds ``slot`` (-1: released)."""
        self.slot_of_block[first_block] = slot

    def snapshots(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Linear layer ``layer``'s (conv, recurrent) snapshots; (None, None) without."""
        if self.conv_snapshots is None or self.recurrent_snapshots is None:
            return None, None
        return self.conv_snapshots[layer], self.recurrent_snapshots[layer]

    def rollback(self, slot: int, num_tokens: int) -> None:
        """The request in ``slot`` keeps its first ``num_tokens`` tokens: its state becomes the
        one after the token at ``num_tokens - 1``, which the last step (a verification) left in
        a snapshot."""
        if self.conv_snapshots is None or self.recurrent_snapshots is None:
            raise RuntimeError("this state cache keeps no snapshots: speculative decoding was off when it was sized")
        kept = (num_tokens - 1) % self.num_snapshots
        self.conv[:, slot] = self.conv_snapshots[:, slot, kept]
        self.recurrent[:, slot] = self.recurrent_snapshots[:, slot, kept]

    @property
    def nbytes(self) -> int:
        tensors = (self.conv, self.recurrent, self.conv_snapshots, self.recurrent_snapshots)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# What the runner asks of any model; a model without per-request state answers with the
# defaults (every layer on the KV cache, no state).
def state_bytes_per_seq(model: object, num_snapshots: int = 0) -> int:
    """The bytes of one request's state slot, its ``num_snapshots`` snapshots included (0: the
    model keeps none)."""
    size = getattr(model, "state_bytes_per_seq", None)
    return int(size(num_snapshots)) if callable(size) else 0


def allocate_state(model: object, num_slots: int, num_blocks: int, num_snapshots: int = 0) -> LinearStateCache | None:
    """The model's state slots, ``num_slots`` of them with ``num_snapshots`` snapshots each, for
    a KV cache of ``num_blocks``; None for a model without per-request state."""
    allocate = getattr(model, "allocate_state", None)
    return allocate(num_slots, num_blocks, num_snapshots) if callable(allocate) else None
