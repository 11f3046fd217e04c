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
  With a ``sliding_window`` of ``W`` it sees only the last ``W`` of those keys (key ``k`` with
  ``position - k < W``, transformers' sliding-window mask); with a ``softcap`` of ``c`` the
  scaled scores ``s`` become ``c * tanh(s / c)`` before the mask and the softmax (Gemma 2).

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

from .gated_delta import (  # noqa: F401 - a hybrid model's linear attention, re-exported
    causal_conv1d,
    causal_conv1d_decode,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
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
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
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
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - (e - s), seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
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


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts feed-forward: each token's routing-weighted sum of its top-k experts'
    SiLU-gated MLPs. ``x [tokens, hidden]``; ``w13 [experts, 2 * inter, hidden]`` (gate rows
    then up rows); ``w2 [experts, hidden, inter]``; ``topk_weights``/``topk_ids [tokens, k]``.

    Numerics, shared with the Triton kernel: each projection's output rounds to ``x.dtype``;
    SiLU-and-mul as ``silu_and_mul``; the down output times its routing weight (in the
    weight's dtype, e.g. float32) rounds to ``x.dtype`` before the sum over the top-k."""
    tokens, k = topk_ids.shape
    per_choice = torch.zeros((tokens, k, x.shape[1]), dtype=x.dtype, device=x.device)
    for expert in range(w13.shape[0]):
        token, choice = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        h = silu_and_mul(x[token] @ w13[expert].T) @ w2[expert].T
        per_choice[token, choice] = (h * topk_weights[token, choice].unsqueeze(-1)).to(x.dtype)
    return per_choice.sum(dim=1)
