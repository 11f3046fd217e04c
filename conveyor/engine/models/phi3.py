"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama layers with the checkpoint's projections
already fused (``qkv_proj``, ``gate_up_proj``, in the order our fused tensors use), LongRoPE
scaling and partial rotary (both in ``ModelSpec`` and the shared ``RotaryEmbedding``).
Only the weight names differ from Llama."""

from __future__ import annotations

from conveyor.engine.distributed.sharding import Shard, WeightSlot
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.layers import MLP, DecoderLayer
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec, decoder_spec, sliding_every_layer


class Phi3ForCausalLM(LlamaForCausalLM):
    def weight_slots(self) -> dict[str, WeightSlot]:
        spec = self.spec
        q_all, kv_all = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        split = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
        slots = {
            name: slot
            for name, slot in super().weight_slots().items()
            if not name.removesuffix(".weight").removesuffix(".bias").endswith(split)
        }
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, MLP)  # (for the type checker)
            p = f"model.layers.{i}."
            # Under tensor parallelism, this rank's rows of each part of the fused tensors.
            a, m = layer.self_attn, layer.mlp
            q, kv, d = a.q_size, a.kv_size, spec.head_dim
            qkv = Shard(
                0,
                (
                    (a.heads.head_start * d, q),
                    (q_all + a.heads.kv_head_start * d, kv),
                    (q_all + kv_all + a.heads.kv_head_start * d, kv),
                ),
            )
            inter, inter_all = m.intermediate_size, m.intermediate_size * m.tp.world_size
            gate_up = Shard(0, ((m.inter_start, inter), (inter_all + m.inter_start, inter)))
            slots[p + "self_attn.qkv_proj.weight"] = (a.qkv_weight, 0, q + 2 * kv, qkv)
            slots[p + "mlp.gate_up_proj.weight"] = (m.gate_up_weight, 0, 2 * inter, gate_up)
        return slots


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Phi-3 biases no projection, whatever ``attention_bias`` says; it slides every layer
    when it has a window, and calls LongRoPE by its old names (``su``, ``yarn``)."""
    return decoder_spec(
        config,
        rope_aliases={"su": "longrope", "yarn": "longrope"},
        qkv_bias=False,
        **sliding_every_layer(config.values),
    )


FAMILY = Family(architectures=(Architecture("Phi3ForCausalLM", "phi3", Phi3ForCausalLM),), read_config=read_config)
