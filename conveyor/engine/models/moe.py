"""Mixture-of-experts forward passes: Mixtral (``MixtralForCausalLM``), Qwen2-MoE
(``Qwen2MoeForCausalLM``, with its sigmoid-gated shared expert and dense layers) and Qwen3-MoE
(``Qwen3MoeForCausalLM``). Attention is the Llama family's (Qwen2's qkv bias, Qwen3's q/k norm,
from ``ModelSpec``); only the feed-forward block differs.

Routing (``route``) follows transformers: the router's softmax in float32, the top-k experts,
their weights renormalised to sum to one where the family does (always for Mixtral, with
``norm_topk_prob`` for Qwen). On CPU the experts run on the token-sorted torch path
(``moe_sorted``): every (token, expert) assignment sorted by expert, each expert's MLP run once
over its contiguous slice, the weighted outputs added back per token. On CUDA they run on
the fused Triton kernel (``conveyor.kernels.fused_moe``: two grouped-GEMM launches over every expert,
with no host sync, so an MoE model's decode can be captured in a CUDA graph).

Expert weights are stacked: ``w13`` is ``[experts * 2 * inter, hidden]`` (each expert's gate
rows then its up rows), ``w2`` is ``[experts * hidden, inter]``, so the loader's row slots take
the checkpoint's per-expert tensors as they are (``experts.N.w1/w3/w2`` for Mixtral,
``experts.N.gate_proj/up_proj/down_proj`` for Qwen).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.sharding import Shard, WeightSlot, split
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.layers import MLP, DecoderLayer, FeedForward, _param
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import (
    ModelSpec,
    MoESpec,
    decoder_spec,
    sliding_every_layer,
    sliding_per_layer,
)
from conveyor.kernels import reference
from conveyor.kernels.interpreter import enable_interpreter, is_interpreting, kernels_interpreted


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
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor] = reference.silu_and_mul,
) -> torch.Tensor:
    """The experts' weighted sum for each token, on the token-sorted path.

    ``x [tokens, hidden]``; ``w13 [experts, 2 * inter, hidden]`` (gate then up);
    ``w2 [experts, hidden, inter]``; ``topk_weights``/``topk_ids [tokens, k]``. The
    assignments are sorted by expert (stable, so each expert's tokens keep their order); one
    gate/up matmul, SiLU-and-mul and down matmul per expert that has tokens; each output row
    times its routing weight, added back onto its token (``index_add_``). The only loop is over
    experts; their token counts are read to the host once. ``act_and_mul``: the gated
    activation (SiLU; Gemma 4's experts use GELU)."""
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
        out[rows] = F.linear(act_and_mul(gate_up), w2[expert])
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


MoEExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def fused_moe_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The Triton kernel (``conveyor.kernels.fused_moe.fused_moe``); off CUDA (tests) it runs in Triton's
    interpreter, chosen here if triton has not been imported yet."""
    if device.type != "cuda" and "triton" not in sys.modules and not is_interpreting():
        enable_interpreter()
    # Imported here: it imports Triton, which is optional and must follow the interpreter choice.
    from conveyor.kernels.fused_moe import fused_moe

    if device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"the fused MoE kernel on {device.type} needs Triton's interpreter, but triton was "
            "imported before TRITON_INTERPRET=1 was set"
        )
    return fused_moe


class SparseMoE(FeedForward):
    """One MoE block: router, ``num_experts`` SiLU-gated MLPs, and (Qwen2-MoE) a shared expert
    whose output is scaled by ``sigmoid(shared_expert_gate(x))`` and added."""

    # The experts' path: None picks the fused Triton kernel on CUDA (with triton installed) and
    # the token-sorted torch path elsewhere; True or False forces one (tests run the kernel on
    # CPU in the interpreter).
    use_fused_kernel: bool | None = None

    def __init__(self, spec: ModelSpec, moe: MoESpec, expert_names: tuple[str, str, str], dtype, device) -> None:
        super().__init__()
        self.moe, self.hidden_size, self.expert_names = moe, spec.hidden_size, expert_names
        # Under tensor parallelism, this rank's slice of every expert's intermediate dim.
        self.tp = parallel_state.current()
        self.inter_start, self.intermediate_size = split(moe.intermediate_size, self.tp)
        e, inter, hidden = moe.num_experts, self.intermediate_size, spec.hidden_size
        self.gate_weight = _param(e, hidden, dtype=dtype, device=device)
        self.w13 = _param(e * 2 * inter, hidden, dtype=dtype, device=device)
        self.w2 = _param(e * hidden, inter, dtype=dtype, device=device)
        self.shared_expert: MLP | None = None
        self.shared_gate_weight = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(spec, dtype, device, intermediate_size=moe.shared_intermediate_size)
            self.shared_gate_weight = _param(1, hidden, dtype=dtype, device=device)
        use_fused = self.use_fused_kernel
        if use_fused is None:
            use_fused = torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None
        self.experts: MoEExperts = fused_moe_kernel(torch.device(device)) if use_fused else moe_sorted
        self.fused = use_fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weight_dtype = torch.float32 if moe.fp32_weights else x.dtype
        weights, ids = route(F.linear(x, self.gate_weight), moe.top_k, moe.renormalize, weight_dtype)
        w13 = self.w13.view(moe.num_experts, 2 * self.intermediate_size, self.hidden_size)
        w2 = self.w2.view(moe.num_experts, self.hidden_size, self.intermediate_size)
        out = self.tp.all_reduce(self.experts(x, w13, w2, weights, ids))  # (the shared expert reduces its own)
        if self.shared_expert is not None and self.shared_gate_weight is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate_weight)) * self.shared_expert(x)
        return out

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        moe, hidden = self.moe, self.hidden_size
        inter, start = self.intermediate_size, self.inter_start
        gate, up, down = self.expert_names
        slots: dict[str, WeightSlot] = {f"{prefix}gate.weight": (self.gate_weight, 0, moe.num_experts)}
        for e in range(moe.num_experts):
            p = f"{prefix}experts.{e}."
            slots[f"{p}{gate}.weight"] = (self.w13, e * 2 * inter, inter, Shard.rows(start, inter))
            slots[f"{p}{up}.weight"] = (self.w13, e * 2 * inter + inter, inter, Shard.rows(start, inter))
            slots[f"{p}{down}.weight"] = (self.w2, e * hidden, hidden, Shard.cols(start, inter))
        if self.shared_expert is not None and self.shared_gate_weight is not None:
            slots.update(self.shared_expert.weight_slots(f"{prefix}shared_expert."))
            slots[f"{prefix}shared_expert_gate.weight"] = (self.shared_gate_weight, 0, 1)
        return slots


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE and Qwen3-MoE: the layers ``MoESpec.sparse_layers`` names have a
    ``SparseMoE`` under ``mlp.``, the others a dense MLP."""

    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, max_len, dtype, device)
        # The token-sorted path reads each expert's token count to the host, so only a model
        # whose every MoE block runs the fused kernel can be captured in a CUDA graph.
        self.supports_cuda_graphs = all(m.fused for m in self.modules() if isinstance(m, SparseMoE))

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


def grouped_sigmoid_route(
    router_logits: torch.Tensor, score_bias: torch.Tensor, moe: MoESpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[tokens, experts]`` router logits -> each token's top-k (float32 weights,
    expert ids), chosen on the biased sigmoid scores within the best groups: the router of
    DeepSeek-V3 and GLM-4.5 (transformers' ``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``)."""
    scores = router_logits.sigmoid()
    choice = scores + score_bias
    tokens, experts = choice.shape
    per_group = experts // moe.n_group
    group_scores = choice.view(tokens, moe.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0)
    eligible = group_mask.unsqueeze(-1).expand(-1, moe.n_group, per_group).reshape(tokens, experts)
    choice = choice.masked_fill(~eligible.bool(), float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Mixtral: every layer sparse and sliding when the config has a window. Qwen2-MoE and
    Qwen3-MoE slide only with ``use_sliding_window`` (Qwen2-MoE every other layer below
    ``max_window_layers``, Qwen3-MoE every layer); Qwen2-MoE biases q/k/v unless ``qkv_bias``
    says not, Qwen3-MoE biases o_proj too and norms each head's q and k."""
    cfg = config.values
    model_type, bias, layers = cfg["model_type"], bool(cfg.get("attention_bias", False)), int(cfg["num_hidden_layers"])
    if model_type == "mixtral":
        return decoder_spec(config, moe=every_layer_sparse(cfg, fp32_weights=True), **sliding_every_layer(cfg))
    windowed = bool(cfg.get("use_sliding_window"))
    if model_type == "qwen3_moe":
        return decoder_spec(
            config,
            moe=qwen_moe(cfg, shared_expert=False, renormalize=False),
            o_bias=bias,
            qk_norm=True,
            **(sliding_every_layer(cfg) if windowed else sliding_every_layer({})),
        )
    limit = int(cfg.get("max_window_layers", 28))
    alternate = ["sliding_attention" if (i + 1) % 2 and i < limit else "full_attention" for i in range(layers)]
    return decoder_spec(
        config,
        moe=qwen_moe(cfg, shared_expert=True, renormalize=False),
        qkv_bias=bool(cfg.get("qkv_bias", True)) or bias,
        **(sliding_per_layer(cfg, lambda: alternate) if windowed else sliding_every_layer({})),
    )


def every_layer_sparse(cfg: dict, *, fp32_weights: bool) -> MoESpec:
    """Every layer a mixture of ``num_local_experts`` experts of ``intermediate_size``, the
    top-k weights renormalised (Mixtral, gpt-oss)."""
    return MoESpec(
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["intermediate_size"]),
        renormalize=True,
        sparse_layers=tuple(range(int(cfg["num_hidden_layers"]))),
        fp32_weights=fp32_weights,
    )


def qwen_moe(cfg: dict, *, shared_expert: bool, renormalize: bool) -> MoESpec:
    """Qwen's sparse layers: every ``decoder_sparse_step``-th layer but the ``mlp_only_layers``;
    ``renormalize``: the default of ``norm_topk_prob``; ``shared_expert``: whether the family
    has the gated shared expert."""
    layers = int(cfg["num_hidden_layers"])
    # (transformers 5.x writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``)
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return MoESpec(
        num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", renormalize)),
        sparse_layers=sparse,
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if shared_expert else 0,
    )


FAMILY = Family(
    architectures=(
        Architecture("MixtralForCausalLM", "mixtral", MixtralForCausalLM),
        Architecture("Qwen2MoeForCausalLM", "qwen2_moe", MoEForCausalLM),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", MoEForCausalLM),
    ),
    read_config=read_config,
)
