"""The interface every attention backend implements, and the batch it is given.

The model calls its backend once per layer with that layer's new Q/K/V and its paged K/V
cache (``[num_blocks, block_size, num_kv_heads, head_dim]``, the layout of ``conveyor/kernels/``).
The backend writes the new K/V into the cache and returns the attention output. Work that
all layers of a step share (turning the batch into indices and masks) is done once per step,
in ``prepare``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One step's batch as the attention kernels see it (tensors on the model's device)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    max_seq_len: int
    # Host-side view of the same batch (the first ``num_decodes`` requests have one query token).
    num_decodes: int
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @classmethod
    def from_host(
        cls,
        slot_mapping: list[int],
        block_tables: list[list[int]],
        query_lens: list[int],
        seq_lens: list[int],
        num_decodes: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """The batch from host lists, one entry per request (block tables of any lengths,
        padded with block 0), on ``device``."""
        max_blocks = max(len(t) for t in block_tables)
        tables = np.array([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=np.int32)
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_tables=torch.from_numpy(tables).to(device),
            query_start_loc=torch.from_numpy(query_start).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )


class AttentionBackend(ABC):
    name: ClassVar[str]
    meta: AttentionMetadata  # the step's batch, set by ``prepare``

    def mla_decode(self, q: torch.Tensor, latent_cache: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """Multi-head latent attention of the step's decode rows (the first ``num_decodes``)
        over their requests' latent caches, in the latent space: ``conveyor.kernels.reference.mla_decode``
        (the layout and the meaning), by this backend's kernel."""
        raise NotImplementedError(f"the {self.name} attention backend has no latent-attention decode")

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers, before the step's first ``forward``."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` (``[num_tokens, num_kv_heads, head_dim]``) into the caches at the
        step's slots, then return each query token's causal attention over its request's
        context: ``q`` and the result are ``[num_tokens, num_q_heads, head_dim]``. With a
        ``sliding_window`` of ``W`` a query sees only the last ``W`` keys up to its own; with a
        ``softcap`` of ``c`` the scaled scores ``s`` become ``c * tanh(s / c)`` (Gemma 2); with
        ``sinks`` (``[num_q_heads]``, gpt-oss) each head's softmax has that head's sink as one
        more logit in its denominator, with no value."""
