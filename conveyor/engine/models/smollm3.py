"""SmolLM3 (``SmolLM3ForCausalLM``): the Llama layers, with RoPE left out of the layers
``no_rope_layers`` marks 0 (NoPE layers: their queries and keys are not turned), as
transformers' ``modeling_smollm3`` does; with ``use_sliding_window``, sliding layers per
``layer_types`` (``ModelSpec.layer_window``)."""

from __future__ import annotations

import torch

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.models.llama import LlamaForCausalLM


def no_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q, k


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @torch.inference_mode()
    def forward(self, input_ids, positions, backend: AttentionBackend, kv_caches) -> torch.Tensor:
        x = self.embed(input_ids)
        turns = self.spec.rope_layers or (True,) * len(self.layers)
        for layer, kv_cache, rope in zip(self.layers, kv_caches, turns, strict=True):
            x = layer(x, positions, self.rope if rope else no_rope, backend, kv_cache)
        return self.norm(x)
