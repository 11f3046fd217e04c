"""Mixture-of-experts forward passes: Mixtral (``MixtralForCausalLM``), Qwen2-MoE
(``Qwen2MoeForCausalLM``, with its sigmoid-gated shared expert and dense layers) and Qwen3-MoE
(``Qwen3MoeForCausalLM``). Attention is the Llama family's (Qwen2's qkv bias, Qwen3's q/k norm,
from ``ModelSpec``); only the feed-forward block differs.

Routing (``route``) follows transformers: the router's softmax in float32, the top-k experts,
their weights renormalised to sum to one where the family does (always for Mixtral, with
``norm_topk_prob`` for Qwen). The experts run on the token-sorted torch path
(``moe_sorted``): every (token, expert) assignment sorted by expert, each expert's MLP run once
over its contiguous slice, the weighted outputs added back per token.

Expert weights are stacked: ``w13`` is ``[experts * 2 * inter, hidden]`` (each expert's gate
rows then its up rows), ``w2`` is ``[experts * hidden, inter]``, so the loader's row slots take
the checkpoint's per-expert tensors as they are (``experts.N.w1/w3/w2`` for Mixtral,
``experts.N.gate_proj/up_proj/down_proj`` for Qwen).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.llama import MLP, DecoderLayer, FeedForward, LlamaForCausalLM, _param
from engine.models.model_config import ModelSpec, MoESpec
from kernels import reference


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, experts]`` router logits -> each token's top-k (weights in ``weight_dtype``,
    expert ids), as transformers routes: softmax in float32, top-k, renormalised if asked."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids


def moe_sorted(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The experts' weighted sum for each token, on the token-sorted path.

    ``x [tokens, hidden]``; ``w13 [experts, 2 * inter, hidden]`` (gate then up);
    ``w2 [experts, hidden, inter]``; ``topk_weights``/``topk_ids [tokens, k]``. The
    assignments are sorted by expert (stable, so each expert's tokens keep their order); one
    gate/up matmul, SiLU-and-mul and down matmul per expert that has tokens; each output row
    times its routing weight, added back onto its token (``index_add_``). The only loop is over
    experts; their token counts are read to the host once."""
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // k  # the token each sorted assignment came from
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    sorted_x = x[token_of]
    out = torch.empty_like(sorted_x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate_up = F.linear(sorted_x[rows], w13[expert])
        out[rows] = F.linear(reference.silu_and_mul(gate_up), w2[expert])
        start += count
    weighted = (out * topk_weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, weighted)


def moe_naive(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The same sum, one token and one chosen expert at a time: the tests' oracle."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = F.linear(reference.silu_and_mul(F.linear(x[t : t + 1], w13[e])), w2[e])
            out[t] += (h[0] * topk_weights[t, j]).to(x.dtype)
    return out


class SparseMoE(FeedForward):
    """One MoE block: router, ``num_experts`` SiLU-gated MLPs, and (Qwen2-MoE) a shared expert
    whose output is scaled by ``sigmoid(shared_expert_gate(x))`` and added."""

    def __init__(self, spec: ModelSpec, moe: MoESpec, expert_names: tuple[str, str, str], dtype, device) -> None:
        super().__init__()
        self.moe, self.hidden_size, self.expert_names = moe, spec.hidden_size, expert_names
        e, inter, hidden = moe.num_experts, moe.intermediate_size, spec.hidden_size
        self.gate_weight = _param(e, hidden, dtype=dtype, device=device)
        self.w13 = _param(e * 2 * inter, hidden, dtype=dtype, device=device)
        self.w2 = _param(e * hidden, inter, dtype=dtype, device=device)
        self.shared_expert: MLP | None = None
        self.shared_gate_weight = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(spec, dtype, device, intermediate_size=moe.shared_intermediate_size)
            self.shared_gate_weight = _param(1, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weight_dtype = torch.float32 if moe.fp32_weights else x.dtype
        weights, ids = route(F.linear(x, self.gate_weight), moe.top_k, moe.renormalize, weight_dtype)
        w13 = self.w13.view(moe.num_experts, 2 * moe.intermediate_size, self.hidden_size)
        w2 = self.w2.view(moe.num_experts, self.hidden_size, moe.intermediate_size)
        out = moe_sorted(x, w13, w2, weights, ids)
        if self.shared_expert is not None and self.shared_gate_weight is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate_weight)) * self.shared_expert(x)
        return out

    def weight_slots(self, prefix: str) -> dict[str, tuple[torch.Tensor, int, int]]:
        moe, hidden = self.moe, self.hidden_size
        inter = moe.intermediate_size
        gate, up, down = self.expert_names
        slots: dict[str, tuple[torch.Tensor, int, int]] = {
            f"{prefix}gate.weight": (self.gate_weight, 0, moe.num_experts)
        }
        for e in range(moe.num_experts):
            p = f"{prefix}experts.{e}."
            slots[f"{p}{gate}.weight"] = (self.w13, e * 2 * inter, inter)
            slots[f"{p}{up}.weight"] = (self.w13, e * 2 * inter + inter, inter)
            slots[f"{p}{down}.weight"] = (self.w2, e * hidden, hidden)
        if self.shared_expert is not None and self.shared_gate_weight is not None:
            slots.update(self.shared_expert.weight_slots(f"{prefix}shared_expert."))
            slots[f"{prefix}shared_expert_gate.weight"] = (self.shared_gate_weight, 0, 1)
        return slots


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE and Qwen3-MoE: the layers ``MoESpec.sparse_layers`` names have a
    ``SparseMoE`` under ``mlp.``, the others a dense MLP."""

    # The token-sorted path reads each expert's token count to the host: no CUDA graphs.
    supports_cuda_graphs = False
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        moe = self.spec.moe
        if moe is None:
            raise ValueError(f"{self.spec.architecture} needs the config's mixture-of-experts fields")
        if index not in moe.sparse_layers:
            return DecoderLayer(self.spec, dtype, device)
        return DecoderLayer(self.spec, dtype, device, SparseMoE(self.spec, moe, self.expert_names, dtype, device))


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: every layer sparse, its block named ``block_sparse_moe`` with experts' ``w1``
    (gate), ``w3`` (up) and ``w2`` (down)."""

    mlp_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")
