"""The MoE block of DeepSeek-V3 and GLM-4.5 (transformers' ``DeepseekV3MoE`` and ``Glm4MoeMoE``
are the same module): ``SparseMoE``'s routed experts, chosen by ``moe.grouped_sigmoid_route``
from a float32 router with a per-expert correction bias, plus ungated shared experts (one MLP
of ``n_shared_experts`` widths) when the config has them."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from conveyor.engine.distributed.sharding import WeightSlot
from conveyor.engine.models.layers import MLP, _param
from conveyor.engine.models.model_config import ModelSpec, MoESpec
from conveyor.engine.models.moe import SparseMoE, grouped_sigmoid_route

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # each routed expert's tensors


class GroupedSigmoidMoE(SparseMoE):
    def __init__(self, spec: ModelSpec, moe: MoESpec, dtype: torch.dtype, device: torch.device) -> None:
        # (no gated Qwen2-MoE shared expert from the base class: this one is added as it is)
        super().__init__(spec, dataclasses.replace(moe, shared_intermediate_size=0), EXPERT_NAMES, dtype, device)
        self.moe = moe
        # transformers keeps the router in float32 whatever the model's dtype.
        self.gate_weight = _param(moe.num_experts, spec.hidden_size, dtype=torch.float32, device=device)
        self.correction_bias = _param(moe.num_experts, dtype=torch.float32, device=device)
        self.shared_experts = (
            MLP(spec, dtype, device, intermediate_size=moe.shared_intermediate_size)
            if moe.shared_intermediate_size
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weights, ids = grouped_sigmoid_route(F.linear(x.float(), self.gate_weight), self.correction_bias, moe)
        w13 = self.w13.view(moe.num_experts, 2 * self.intermediate_size, self.hidden_size)
        w2 = self.w2.view(moe.num_experts, self.hidden_size, self.intermediate_size)
        out = self.tp.all_reduce(self.experts(x, w13, w2, weights, ids))  # (the shared experts reduce their own)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        slots = super().weight_slots(prefix)
        slots[f"{prefix}gate.e_score_correction_bias"] = (self.correction_bias, 0, self.moe.num_experts)
        if self.shared_experts is not None:
            slots.update(self.shared_experts.weight_slots(f"{prefix}shared_experts."))
        return slots
