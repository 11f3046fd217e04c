"""The ``torch`` attention backend: the CPU path, in plain torch.

Per step, ``prepare`` turns the batch into gather indices and masks once; each layer then
writes its new K/V into the cache and runs attention: decode tokens (the runner puts them
first, sorted by context length) batched in buckets of similar length, and one
``scaled_dot_product_attention`` call per prefill chunk. When all decodes share a long
cached prefix (a common system prompt), it is attended to once for all of them and merged
with each request's own part by log-sum-exp (cascade attention).

A layer with a sliding window gets its own decode plan (each request reads only the blocks its
window reaches, masked to the window; no cascade, since the shared prefix may lie outside it); a soft cap on the
scores (Gemma 2) or attention sinks (gpt-oss: one more logit per head in the softmax, with no
value; no cascade either) replace ``scaled_dot_product_attention`` by explicit scores for prefills.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.engine.attention.base import AttentionBackend, AttentionMetadata
from conveyor.kernels import reference
from conveyor.kernels.utils import cdiv

# Decodes are batched in buckets of similar context length (the runner sorts them), each padded
# only to its own longest context: a bucket's longest is at most this factor of its shortest.
DECODE_BUCKET_GROWTH = 1.25
# Cascade attention: when all decodes share at least this many prefix tokens (the same cached
# blocks), that prefix is read once for all of them instead of once per request.
CASCADE_MIN_SHARED_TOKENS = 256
CASCADE_MIN_DECODES = 4
# The decode plan of full attention without the cascade (attention sinks: the shared prefix's
# partial sums would be merged without the sink).
NO_CASCADE = "no cascade"

# A bucket of decodes: (first, end) rows, their block tables past the shared prefix, and the
# additive mask that hides each row's padding.
DecodeBucket = tuple[int, int, torch.Tensor, torch.Tensor]


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self._slots = meta.slot_mapping.long()
        # Per sliding window (None: full causal; ``NO_CASCADE``: full, for sinks): the shared
        # prefix blocks and the buckets.
        self._plans: dict[int | str | None, tuple[torch.Tensor | None, list[DecodeBucket]]] = {}
        # Per prefill chunk: (request, first query row, query tokens, context tokens).
        self._prefills: list[tuple[int, int, int, int]] = []
        start = meta.num_decodes
        for b in range(meta.num_decodes, len(meta.query_lens_host)):
            q_len, seq_len = meta.query_lens_host[b], meta.seq_lens_host[b]
            self._prefills.append((b, start, q_len, seq_len))
            start += q_len

    def _decode_plan(
        self, block_size: int, dtype: torch.dtype, window: int | None, cascade: bool = True
    ) -> tuple[torch.Tensor | None, list[DecodeBucket]]:
        """Built once per step and window: the block ids all decodes share (or None), and the buckets."""
        key = NO_CASCADE if window is None and not cascade else window  # (windows never cascade)
        if key not in self._plans:
            meta = self.meta
            nd = meta.num_decodes
            lens = meta.seq_lens_host[:nd]
            tables = meta.block_tables[:nd]
            shared_blocks = 0
            if cascade and window is None and nd >= CASCADE_MIN_DECODES and min(lens) > CASCADE_MIN_SHARED_TOKENS:
                same = (tables == tables[:1]).all(dim=0).int().cumprod(dim=0)
                # Never the block holding a request's newest token: that one is its own.
                shared_blocks = min(int(same.sum()), (min(lens) - 1) // block_size)
                if shared_blocks * block_size < CASCADE_MIN_SHARED_TOKENS:
                    shared_blocks = 0
            shared = tables[0, :shared_blocks].long() if shared_blocks else None
            # Blocks each request skips at the front: the shared prefix (read once, above), or
            # those wholly before its window.
            skip = [shared_blocks] * nd if window is None else [max(0, n - window) // block_size for n in lens]
            own = [n - k * block_size for n, k in zip(lens, skip, strict=True)]
            skip_t = torch.tensor(skip, dtype=torch.long, device=tables.device)
            buckets: list[DecodeBucket] = []
            first = 0
            while first < nd:
                end = first + 1
                while end < nd and own[end] <= own[first] * DECODE_BUCKET_GROWTH:
                    end += 1
                num_blocks = cdiv(max(own[first:end]), block_size)
                # (past a row's own blocks: any valid entry, masked below)
                cols = (skip_t[first:end, None] + torch.arange(num_blocks, device=tables.device)).clamp_(
                    max=tables.shape[1] - 1
                )
                bucket_tables = tables[first:end].long().gather(1, cols)
                positions = torch.arange(num_blocks * block_size, device=tables.device)
                own_lens = meta.seq_lens[first:end].long().unsqueeze(1) - skip_t[first:end, None] * block_size
                visible = positions.unsqueeze(0) < own_lens
                if window is not None:  # (a decode's query is its last token)
                    visible &= positions.unsqueeze(0) >= own_lens - window
                mask = torch.zeros(visible.shape, dtype=dtype, device=tables.device).masked_fill_(
                    ~visible, float("-inf")
                )
                buckets.append((first, end, bucket_tables, mask))
                first = end
            self._plans[key] = (shared, buckets)
        return self._plans[key]

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
        meta = self.meta
        num_kv_heads = k_cache.shape[2]
        # The engine never produces negative (skipped) slots, so a plain index_copy_ will do.
        _store(k_cache, self._slots, k)
        _store(v_cache, self._slots, v)
        group = q.shape[1] // num_kv_heads
        out = torch.empty_like(q)
        if meta.num_decodes:
            self._decode(q, k_cache, v_cache, scale, out, group, sliding_window, softcap, sinks)
        for b, start, q_len, seq_len in self._prefills:
            qb = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            if seq_len == q_len:  # nothing cached before this chunk: use the fresh K/V directly
                # (through the cache's dtype, as a later read would see them: a no-op unless FP8)
                kb = k[start : start + q_len].to(k_cache.dtype).to(q.dtype)
                vb = v[start : start + q_len].to(v_cache.dtype).to(q.dtype)
            else:
                tables = meta.block_tables[b]
                kb = reference.gather_kv(k_cache, tables, seq_len).to(q.dtype)
                vb = reference.gather_kv(v_cache, tables, seq_len).to(q.dtype)
            # SDPA shares each KV head with its query group itself (``enable_gqa``): no copies.
            kb, vb = kb.transpose(0, 1).unsqueeze(0), vb.transpose(0, 1).unsqueeze(0)
            gqa = group > 1
            if seq_len == q_len and sliding_window is None and softcap is None and sinks is None:
                ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
                k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
                visible = k_pos <= q_pos
                if sliding_window is not None:
                    visible &= k_pos > q_pos - sliding_window
                if sinks is not None:
                    kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
                    ob = _sink_attention(qb, kb, vb, visible, scale, sinks)
                elif softcap is None:
                    ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, scale=scale, enable_gqa=gqa)
                else:
                    kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
                    ob = _softcapped_attention(qb, kb, vb, visible, scale, softcap)
            out[start : start + q_len] = ob[0].transpose(0, 1)
        return out

    def mla_decode(self, q: torch.Tensor, latent_cache: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
        nd = self.meta.num_decodes
        return reference.mla_decode(
            q, latent_cache, self.meta.block_tables[:nd], self.meta.seq_lens[:nd], scale, kv_lora_rank
        )

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        group: int,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        shared, buckets = self._decode_plan(k_cache.shape[1], q.dtype, window, cascade=sinks is None)
        nd = self.meta.num_decodes
        queries = q[:nd].view(nd, num_kv_heads, group, head_dim)
        prefix = (
            _shared_prefix_partials(queries, k_cache, v_cache, shared, scale, softcap) if shared is not None else None
        )
        for first, end, tables, mask in buckets:
            n = end - first
            keys = k_cache[tables].flatten(1, 2).to(q.dtype)  # [n, L, Hkv, D]
            values = v_cache[tables].flatten(1, 2).to(q.dtype)
            dest = out[first:end].view(n, num_kv_heads, group, head_dim)
            bias = mask.unsqueeze(1).expand(n, group, mask.shape[1])
            # One KV head at a time: strided views feed bmm directly, with no transposed copies.
            for h in range(num_kv_heads):
                if softcap is None:
                    scores = torch.baddbmm(bias, queries[first:end, h], keys[:, :, h].transpose(1, 2), alpha=scale)
                else:
                    raw = torch.bmm(queries[first:end, h], keys[:, :, h].transpose(1, 2)) * scale
                    scores = torch.tanh(raw / softcap) * softcap + bias
                if sinks is not None:  # (never a shared prefix: see ``_decode_plan``)
                    sink = sinks[h * group : (h + 1) * group].to(scores.dtype).view(1, group, 1).expand(n, group, 1)
                    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
                    dest[:, h] = torch.bmm(probs, values[:, :, h])
                    continue
                if prefix is None:
                    dest[:, h] = torch.bmm(scores.softmax(dim=-1), values[:, :, h])
                    continue
                # Merge with the shared prefix's partial result by log-sum-exp.
                o_s, m_s, l_s = (t[first:end, h] for t in prefix)
                m_u = scores.amax(dim=-1, keepdim=True)
                e_u = torch.exp(scores - m_u)
                m = torch.maximum(m_s, m_u)
                a, b = torch.exp(m_s - m), torch.exp(m_u - m)
                o_u = torch.bmm(e_u, values[:, :, h])
                dest[:, h] = (o_s * a + o_u * b) / (l_s * a + e_u.sum(dim=-1, keepdim=True) * b)


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``x`` into ``cache``'s ``slots`` in the cache's dtype: an FP8 cache stores e4m3 with a
    scale of 1 (read back in the queries' dtype), its bytes copied (no float8 ``index_copy_``
    on CPU)."""
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == torch.float8_e4m3fn:
        flat.view(torch.uint8).index_copy_(0, slots, x.to(cache.dtype).view(torch.uint8))
    else:
        flat.index_copy_(0, slots, x.to(cache.dtype))


def _shared_prefix_partials(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    shared_blocks: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised attention of every decode query over the prefix all of them share, read
    once: (output, running max, sum of exponentials), each ``[nd, Hkv, G, ...]``."""
    nd, num_kv_heads, group, head_dim = queries.shape
    keys = k_cache[shared_blocks].flatten(0, 1).to(queries.dtype)  # [Ls, Hkv, D]
    values = v_cache[shared_blocks].flatten(0, 1).to(queries.dtype)
    out = torch.empty_like(queries)
    maxes = queries.new_empty(nd, num_kv_heads, group, 1)
    sums = queries.new_empty(nd, num_kv_heads, group, 1)
    for h in range(num_kv_heads):
        scores = torch.matmul(queries[:, h].reshape(nd * group, head_dim), keys[:, h].T) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        m = scores.amax(dim=-1, keepdim=True)
        e = torch.exp(scores - m)
        out[:, h] = torch.matmul(e, values[:, h]).view(nd, group, head_dim)
        maxes[:, h] = m.view(nd, group, 1)
        sums[:, h] = e.sum(dim=-1, keepdim=True).view(nd, group, 1)
    return out, maxes, sums


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager Gemma 2 attention computes it
    (``[1, H, q_len, D]`` in and out; ``visible`` is ``[q_len, kv_len]``)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)


def _sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention with a sink logit per head, as transformers' eager gpt-oss attention computes
    it (``[1, H, q_len, D]`` in and out; ``visible`` is ``[q_len, kv_len]``; ``sinks`` ``[H]``):
    the sink joins each row's softmax, in the scores' dtype, and is dropped after it."""
    scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = logits.softmax(dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
