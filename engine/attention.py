"""Attention backends behind one interface, all over the same paged KV layout.

- ``torch``: the CPU path. Per step, ``prepare`` turns the batch into gather indices and masks
  once; each layer then writes its new K/V into the cache and runs attention: decode tokens
  (the runner puts them first, sorted by context length) batched in buckets of similar
  length, and one ``scaled_dot_product_attention`` call per prefill chunk.
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


# Decodes are batched in buckets of similar context length (the runner sorts them), each padded
# only to its own longest context: a bucket's longest is at most this factor of its shortest.
DECODE_BUCKET_GROWTH = 1.25


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self._slots = meta.slot_mapping.long()
        self._buckets: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None
        self._prefills = []
        start = meta.num_decodes
        for b in range(meta.num_decodes, len(meta.query_lens_host)):
            q_len, seq_len = meta.query_lens_host[b], meta.seq_lens_host[b]
            self._prefills.append((b, start, q_len, seq_len))
            start += q_len

    def _decode_buckets(self, block_size: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(first, end, block tables, additive padding mask) per bucket, built once per step."""
        if self._buckets is None:
            meta, lens = self.meta, self.meta.seq_lens_host
            self._buckets = []
            first = 0
            while first < meta.num_decodes:
                end = first + 1
                while end < meta.num_decodes and lens[end] <= lens[first] * DECODE_BUCKET_GROWTH:
                    end += 1
                num_blocks = -(-max(lens[first:end]) // block_size)
                tables = meta.block_tables[first:end, :num_blocks].long()
                positions = torch.arange(num_blocks * block_size, device=tables.device)
                visible = positions.unsqueeze(0) < meta.seq_lens[first:end].long().unsqueeze(1)
                mask = torch.zeros(visible.shape, device=tables.device).masked_fill_(~visible, float("-inf"))
                self._buckets.append((first, end, tables, mask))
                first = end
        return self._buckets

    def forward(self, q, k, v, k_cache, v_cache, scale):
        meta = self.meta
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        # The engine never produces negative (skipped) slots, so a plain index_copy_ will do.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self._slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self._slots, v)
        group = q.shape[1] // num_kv_heads
        out = torch.empty_like(q)
        if meta.num_decodes:
            self._decode(q, k_cache, v_cache, scale, out, group)
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

    def _decode(self, q, k_cache, v_cache, scale, out, group) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        for first, end, tables, mask in self._decode_buckets(k_cache.shape[1]):
            n = end - first
            keys = k_cache[tables].flatten(1, 2)  # [n, L, Hkv, D]
            values = v_cache[tables].flatten(1, 2)
            queries = q[first:end].view(n, num_kv_heads, group, head_dim)
            dest = out[first:end].view(n, num_kv_heads, group, head_dim)
            bias = mask.unsqueeze(1).expand(n, group, mask.shape[1])
            # One KV head at a time: strided views feed bmm directly, with no transposed copies.
            for h in range(num_kv_heads):
                scores = torch.baddbmm(bias, queries[:, h], keys[:, :, h].transpose(1, 2), alpha=scale)
                dest[:, h] = torch.bmm(scores.softmax(dim=-1), values[:, :, h])


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_backend() is not None else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        backend = _triton_backend()
        if backend is None:
            raise ValueError("attention_backend='triton' needs the triton package (pip install 'conveyor[triton]')")
        return backend(device)
    raise ValueError(f"unknown attention backend {name!r}")


def _triton_backend() -> type[AttentionBackend] | None:
    try:
        from engine.triton_attention import TritonAttention
    except ImportError:
        return None
    return TritonAttention
