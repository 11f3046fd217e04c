"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama layers with the checkpoint's projections
already fused (``qkv_proj``, ``gate_up_proj``, in the order our fused tensors use), LongRoPE
scaling and partial rotary (both in ``ModelSpec`` and the shared ``RotaryEmbedding``).
Only the weight names differ from Llama."""

from __future__ import annotations

import torch

from engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def weight_slots(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        spec = self.spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        split = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
        slots = {
            name: slot
            for name, slot in super().weight_slots().items()
            if not name.removesuffix(".weight").removesuffix(".bias").endswith(split)
        }
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, MLP)  # (for the type checker)
            p = f"model.layers.{i}."
            slots[p + "self_attn.qkv_proj.weight"] = (layer.self_attn.qkv_weight, 0, q + 2 * kv)
            slots[p + "mlp.gate_up_proj.weight"] = (layer.mlp.gate_up_weight, 0, 2 * spec.intermediate_size)
        return slots
