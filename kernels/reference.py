"""Pure-torch references for the kernels, written for clarity: the test oracle, and the CPU
path (the torch attention backend and the model's norms and activations use them).

Layouts (shared with the Triton kernels and the engine):
- K/V cache per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- ``slot_mapping[t] = block_id * block_size + offset``; a negative slot is skipped.
- Paged attention over a flat, unpadded batch: ``q`` is ``[num_tokens, num_q_heads, head_dim]``
  with request ``b``'s tokens at ``query_start_loc[b]:query_start_loc[b+1]``; ``seq_lens[b]``
  counts its context including those new tokens (already written to the cache). Query token
  ``i`` of a request with ``q_len`` new tokens sits at position ``seq_len - q_len + i`` and sees
  keys ``0..position``: one definition for decode, prefill, chunked prefill and prefill over
  a cached prefix. Query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.

Numerics of RMSNorm and SiLU-and-mul follow the Hugging Face Llama/Qwen modules exactly, so
a model gives transformers' outputs through either the reference or the Triton kernel
(beyond reduction order):
- RMSNorm: the residual add rounds to the input dtype first (``h = x + residual``); the
  statistics are computed in fp32; the normalised value is rounded to the input dtype and
  then multiplied by the weight (``weight * h_normed.to(dtype)``).
- SiLU-and-mul: ``silu(gate)`` is rounded to the input dtype, then multiplied by ``up``.
"""

from __future__ import annotations

import torch

from .utils import cdiv


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request's K or V: ``[seq_len, num_kv_heads, head_dim]``."""
    num_blocks = cdiv(seq_len, cache.shape[1])
    return cache[block_ids[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    group = q.shape[1] // k_cache.shape[2]
    for b, seq_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        qb = q[s:e].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(seq_len - (e - s), seq_len).unsqueeze(1)
        visible = torch.arange(seq_len).unsqueeze(0) <= q_pos
        scores = scores.masked_fill(~visible, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
):
    """``x [..., hidden]`` -> ``out`` or, with ``residual``, ``(out, x + residual)``."""
    h = x if residual is None else (x + residual)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, h)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2 * d]`` (gate then up, as a fused gate_up projection) -> ``[..., d]``."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    act = torch.nn.functional.silu(gate.float()).to(x.dtype)
    return (act.float() * up.float()).to(x.dtype)
