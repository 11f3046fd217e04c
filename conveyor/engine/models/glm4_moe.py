"""GLM-4.5 / GLM-4.6 MoE (``Glm4MoeForCausalLM``): the Llama layers (qkv bias and q/k norm
from the config, partial rotary: the first half of each head turns) with the first
``first_k_dense_replace`` layers dense and the rest a mixture of experts, following
transformers' ``Glm4MoeMoE`` (DeepSeek-V3's block, ``GroupedSigmoidMoE``):

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

import torch

from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.grouped_sigmoid_moe import GroupedSigmoidMoE
from conveyor.engine.models.layers import DecoderLayer
from conveyor.engine.models.model_config import ModelSpec, MoESpec, decoder_spec
from conveyor.engine.models.moe import MoEForCausalLM


class Glm4MoeForCausalLM(MoEForCausalLM):
    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        moe = self.spec.moe
        if moe is None:
            raise ValueError(f"{self.spec.architecture} needs the config's mixture-of-experts fields")
        if index not in moe.sparse_layers:
            return DecoderLayer(self.spec, dtype, device)
        return DecoderLayer(self.spec, dtype, device, GroupedSigmoidMoE(self.spec, moe, dtype, device))

    def skips_weight(self, name: str) -> bool:
        return self.beyond_last_layer(name)


def read_config(config: CheckpointConfig) -> ModelSpec:
    """q/k norm with ``use_qk_norm``; the MoE layers after the first ``first_k_dense_replace``."""
    cfg = config.values
    num_experts, groups = int(cfg["n_routed_experts"]), int(cfg.get("n_group") or 1)
    if num_experts % groups or num_experts // groups < 2:
        raise ValueError(f"n_routed_experts {num_experts} must split into n_group {groups} groups of 2 or more")
    moe = MoESpec(
        num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=tuple(range(int(cfg.get("first_k_dense_replace", 1)), int(cfg["num_hidden_layers"]))),
        shared_intermediate_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0),
        fp32_weights=True,
        n_group=groups,
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )
    return decoder_spec(config, moe=moe, qk_norm=bool(cfg.get("use_qk_norm", False)))


FAMILY = Family(
    architectures=(Architecture("Glm4MoeForCausalLM", "glm4_moe", Glm4MoeForCausalLM),), read_config=read_config
)
