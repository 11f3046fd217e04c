"""Attention backends behind one interface, all over the same paged KV layout.

- ``torch``: the CPU path. Per step, ``prepare`` turns the batch into gather indices and masks
  once; each layer then writes its new K/V into the cache and runs attention: one batched,
  padded computation for all decode tokens (the runner puts decodes first) and one
  ``scaled_dot_product_attention`` call per prefill chunk.
- ``triton``: the GPU path (``kernels/``), chosen automatically on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference


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


class AttentionBackend:
    name = "base"

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        nd = meta.num_decodes
        self._decode_tables: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._prefills = []
        start = nd
        for b in range(nd, len(meta.query_lens_host)):
            q_len, seq_len = meta.query_lens_host[b], meta.seq_lens_host[b]
            self._prefills.append((b, start, q_len, seq_len))
            start += q_len

    def _decode_inputs(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables cut to the longest decode context, and the additive padding mask."""
        if self._decode_mask is None:
            meta, nd = self.meta, self.meta.num_decodes
            num_blocks = -(-max(meta.seq_lens_host[:nd]) // block_size)
            self._decode_tables = meta.block_tables[:nd, :num_blocks].long()
            positions = torch.arange(num_blocks * block_size, device=meta.seq_lens.device)
            lens = meta.seq_lens[:nd].long().unsqueeze(1)
            self._decode_mask = torch.where(positions.unsqueeze(0) < lens, 0.0, float("-inf"))
        return self._decode_tables, self._decode_mask

    def forward(self, q, k, v, k_cache, v_cache, scale):
        meta = self.meta
        reference.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // num_kv_heads
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            tables, mask = self._decode_inputs(k_cache.shape[1])
            # [nd, L, Hkv, D] -> [nd, Hkv, L, D]; queries grouped by their KV head.
            kd = k_cache[tables].flatten(1, 2).transpose(1, 2)
            vd = v_cache[tables].flatten(1, 2).transpose(1, 2)
            qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
            scores = torch.matmul(qd, kd.transpose(-1, -2)) * scale
            scores = scores + mask[:, None, None, :]
            out[:nd] = torch.matmul(scores.softmax(dim=-1), vd).view(nd, -1, head_dim)
        for b, start, q_len, seq_len in self._prefills:
            qb = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            if seq_len == q_len:  # nothing cached before this chunk: use the fresh K/V directly
                kb, vb = k[start : start + q_len], v[start : start + q_len]
            else:
                tables = meta.block_tables[b]
                kb = reference.gather_kv(k_cache, tables, seq_len)
                vb = reference.gather_kv(v_cache, tables, seq_len)
            kb = kb.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
            vb = vb.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
            if seq_len == q_len:
                ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
            else:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
                visible = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
                ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, scale=scale)
            out[start : start + q_len] = ob[0].transpose(0, 1)
        return out


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_backend() is not None else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        backend = _triton_backend()
        if backend is None:
            raise ValueError("attention_backend='triton' needs the triton package and engine/triton_attention.py")
        return backend()
    raise ValueError(f"unknown attention backend {name!r}")


def _triton_backend() -> type[AttentionBackend] | None:
    try:
        from engine.triton_attention import TritonAttention
    except ImportError:
        return None
    return TritonAttention
