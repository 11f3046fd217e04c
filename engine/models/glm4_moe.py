"""GLM-4.5 / GLM-4.6 MoE (``Glm4MoeForCausalLM``): the Llama layers (qkv bias and q/k norm
from the config, partial rotary: the first half of each head turns) with the first
``first_k_dense_replace`` layers dense and the rest a mixture of experts, following
transformers' ``Glm4MoeMoE``:

- the router (``gate``) runs in float32 on float32 weights and scores every expert with a
  sigmoid; a learnt per-expert bias (``e_score_correction_bias``) is added to the scores to
  *choose* the experts, never to weigh them;
- grouped top-k: the experts fall into ``n_group`` groups, each group is rated by the sum of
  its two best biased scores, only the ``topk_group`` best groups stay eligible, and the
  ``top_k`` best biased scores among them are the token's experts;
- their unbiased scores, renormalised to sum to one (``norm_topk_prob``), times
  ``routed_scaling_factor``, weigh the experts' outputs (in float32, as transformers does);
- an always-on shared expert (``n_shared_experts`` experts' width in one MLP), not gated, added.

The checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``, stored as layers
past ``num_hidden_layers``) are not used for decoding and are skipped at load.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.distributed.sharding import WeightSlot
from engine.models.llama import MLP, DecoderLayer, _param
from engine.models.model_config import ModelSpec, MoESpec
from engine.models.moe import MoEForCausalLM, SparseMoE, grouped_sigmoid_route


class Glm4MoE(SparseMoE):
    """GLM's MoE block: ``SparseMoE``'s experts (and their tensor-parallel split), its own
    router and an ungated shared expert under ``shared_experts.``."""

    def __init__(self, spec: ModelSpec, moe: MoESpec, dtype: torch.dtype, device: torch.device) -> None:
        # (no gated Qwen2-MoE shared expert from the base class: GLM's is added as it is)
        super().__init__(
            spec, dataclasses.replace(moe, shared_intermediate_size=0), MoEForCausalLM.expert_names, dtype, device
        )
        self.moe = moe
        # transformers keeps the router in float32 whatever the model's dtype.
        self.gate_weight = _param(moe.num_experts, spec.hidden_size, dtype=torch.float32, device=device)
        self.score_bias = _param(moe.num_experts, dtype=torch.float32, device=device)
        self.shared_experts = MLP(spec, dtype, device, intermediate_size=moe.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weights, ids = grouped_sigmoid_route(F.linear(x.float(), self.gate_weight), self.score_bias, moe)
        w13 = self.w13.view(moe.num_experts, 2 * self.intermediate_size, self.hidden_size)
        w2 = self.w2.view(moe.num_experts, self.hidden_size, self.intermediate_size)
        out = self.tp.all_reduce(self.experts(x, w13, w2, weights, ids))  # (the shared expert reduces its own)
        return out + self.shared_experts(x)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        slots = super().weight_slots(prefix)
        slots[f"{prefix}gate.e_score_correction_bias"] = (self.score_bias, 0, self.moe.num_experts)
        slots.update(self.shared_experts.weight_slots(f"{prefix}shared_experts."))
        return slots


class Glm4MoeForCausalLM(MoEForCausalLM):
    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        moe = self.spec.moe
        if moe is None:
            raise ValueError(f"{self.spec.architecture} needs the config's mixture-of-experts fields")
        if index not in moe.sparse_layers:
            return DecoderLayer(self.spec, dtype, device)
        return DecoderLayer(self.spec, dtype, device, Glm4MoE(self.spec, moe, dtype, device))

    def skips_weight(self, name: str) -> bool:
        return self.beyond_last_layer(name)
