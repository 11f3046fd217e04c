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
  With ``sinks`` (``[num_q_heads]``, gpt-oss) each head's softmax has one more logit in its
  denominator, that head's sink, which has no value: the weights sum to less than one.

Numerics of RMSNorm and SiLU-and-mul follow the Hugging Face Llama/Qwen modules exactly, so
a model gives transformers' outputs through either the reference or the Triton kernel
(beyond reduction order):
- RMSNorm: the residual add rounds to the input dtype first (``h = x + residual``); the
  statistics are computed in fp32; the normalised value is rounded to the input dtype and
  then multiplied by the weight (``weight * h_normed.to(dtype)``).
- SiLU-and-mul: ``silu(gate)`` is rounded to the input dtype, then multiplied by ``up``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    sinks: torch.Tensor | None = None,
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
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, e - s, 1)
            weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            weights = scores.softmax(dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)
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


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation over interleaved gate/up columns (gate ``2 * j``, up
    ``2 * j + 1``): the gate clamped above at ``limit``, up to ``±limit``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``. Each operation rounds to the activation
    dtype, as transformers computes it."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# e2m1 (FP4: sign, two exponent bits, one mantissa bit), by code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Mxfp4Weight:
    """Experts' weights ``[experts, rows, cols]`` (outputs, inputs) in OCP MXFP4, as gpt-oss
    ships them: ``blocks`` uint8 ``[experts, rows, cols / 2]``, two e2m1 codes a byte (the
    lower-indexed input in the low nibble); ``scales`` uint8 ``[experts, rows, cols / 32]``,
    each group of 32 inputs' power of two biased by 127 (e8m0). 4.25 bits a weight."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, half = self.blocks.shape
        return experts, rows, 2 * half

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[experts, rows, cols]``: each code's value times its group's ``2 ** (scale - 127)``."""
        table = torch.tensor(E2M1_VALUES, device=self.blocks.device)
        codes = torch.stack((self.blocks & 0xF, self.blocks >> 4), dim=-1).long()
        values = table[codes].reshape(*self.blocks.shape[:-1], -1, 32)
        scaled = values * torch.exp2(self.scales.float() - 127).unsqueeze(-1)
        return scaled.reshape(self.shape).to(dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | Mxfp4Weight,
    w2: torch.Tensor | Mxfp4Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: ClampedSwiGLU | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixture-of-experts feed-forward: each token's routing-weighted sum of its top-k experts'
    gated MLPs. ``x [tokens, hidden]``; ``w13 [experts, 2 * inter, hidden]`` (gate rows then
    up rows for SiLU, interleaved for ``ClampedSwiGLU``); ``w2 [experts, hidden, inter]``;
    either may be an ``Mxfp4Weight`` of that shape; ``b13 [experts, 2 * inter]`` and
    ``b2 [experts, hidden]`` optional biases; ``topk_weights``/``topk_ids [tokens, k]``.

    Numerics, shared with the Triton kernel: each projection's output rounds to ``x.dtype``,
    then its bias is added (rounding again); the activation as ``silu_and_mul`` or
    ``ClampedSwiGLU``; the down output times its routing weight (in the weight's dtype, e.g.
    float32) rounds to ``x.dtype`` before the sum over the top-k."""
    if isinstance(w13, Mxfp4Weight):
        w13 = w13.dequantize(x.dtype)
    if isinstance(w2, Mxfp4Weight):
        w2 = w2.dequantize(x.dtype)
    act_and_mul = activation or silu_and_mul
    tokens, k = topk_ids.shape
    per_choice = torch.zeros((tokens, k, x.shape[1]), dtype=x.dtype, device=x.device)
    for expert in range(w13.shape[0]):
        token, choice = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = x[token] @ w13[expert].T
        if b13 is not None:
            gate_up = gate_up + b13[expert]
        h = act_and_mul(gate_up) @ w2[expert].T
        if b2 is not None:
            h = h + b2[expert]
        per_choice[token, choice] = (h * topk_weights[token, choice].unsqueeze(-1)).to(x.dtype)
    return per_choice.sum(dim=1)


def mla_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Multi-head latent attention for decode rows, in the latent space (DeepSeek-V3).

    ``latent_cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim]``: each token's
    normalised latent then its rope key. ``q [num_seqs, num_heads, kv_lora_rank + rope_dim]``:
    each request's one query, its no-rope part already absorbed through the heads' key
    projections (``q_nope @ W_UK``) then its rope part, so a score is one dot product with a
    cached row. Returns ``[num_seqs, num_heads, kv_lora_rank]``: the softmax-weighted sum of the
    latents (the caller applies each head's value projection ``W_UV``). Every cached token up to
    ``seq_lens[b]`` is visible (the query is the newest token)."""
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = gather_kv(latent_cache, block_tables[b], seq_len)[:, 0].float()  # [seq_len, width]
        scores = (q[b].float() @ rows.T) * scale  # [heads, seq_len]
        out[b] = (scores.softmax(dim=-1) @ rows[:, :kv_lora_rank]).to(q.dtype)
    return out


def w4a16_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x [M, K] @ W.T`` for the int4 weight of ``conveyor.kernels.quant_gemm``'s layout: ``qweight``
    [N, K/8] int32 (eight inputs a word, lowest bits first), ``W[n, k] = (q[n, k] -
    zeros[n, k // group_size]) * scales[n, k // group_size]``, dequantized in float32."""
    shifts = torch.arange(0, 32, 4, device=qweight.device)
    q = ((qweight.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).reshape(qweight.shape[0], -1)
    zeros = zeros.to(torch.float32).repeat_interleave(group_size, dim=1)
    scales = scales.to(torch.float32).repeat_interleave(group_size, dim=1)
    w = (q.to(torch.float32) - zeros) * scales
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def fp8_block_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``conveyor.kernels.quant_gemm.fp8_block_gemm``: ``W = weight * scale``, one
    scale per ``block`` (the edge blocks short) or, with ``block=None``, one for the tensor."""
    w = weight.to(torch.float32)
    if block is None:
        w = w * scale.to(torch.float32).reshape(())
    else:
        n, k = w.shape
        full = scale.to(torch.float32).repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        w = w * full
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def q8_0_gemm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``conveyor.kernels.quant_gemm.q8_0_gemm``: ``W[n, k] = qs[n, k] * d[n, k // 32]``."""
    w = qs.to(torch.float32) * d.to(torch.float32).repeat_interleave(32, dim=1)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def q4_k_weight(qs: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` a Q4_K weight (``conveyor.kernels.gguf_blocks.split_q4_k``'s parts) stores:
    per 32-input sub-block ``s`` of a 256-input super-block, ``d * sc[s] * q - dmin * m[s]``,
    the 6-bit ``sc``/``m`` unpacked from the block's 12 bytes as llama.cpp's ``get_scale_min_k4``."""
    n = qs.shape[0]
    packed = scales.to(torch.int32).reshape(n, -1, 3, 4)
    low, mid, high = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    sc = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], dim=-1)  # [N, blocks, 8]
    mn = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    nib = qs.to(torch.int32).reshape(n, -1, 4, 1, 32)  # chunks of 32 bytes: sub-blocks 2j (low), 2j+1 (high)
    q = torch.cat([nib & 15, nib >> 4], dim=3).reshape(n, -1, 8, 32).to(torch.float32)
    scale = (d.to(torch.float32).unsqueeze(-1) * sc.to(torch.float32)).unsqueeze(-1)
    offset = (dmin.to(torch.float32).unsqueeze(-1) * mn.to(torch.float32)).unsqueeze(-1)
    return (scale * q - offset).reshape(n, -1)


def q4_k_gemm(
    x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``conveyor.kernels.quant_gemm.q4_k_gemm``, ``W`` as ``q4_k_weight``."""
    return (x.to(torch.float32) @ q4_k_weight(qs, scales, d, dmin).t()).to(x.dtype)
