"""Gemma 2 and Gemma 3 text models (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``): the Llama
layers with Gemma's differences, each following transformers' modules:

- embeddings scaled by ``sqrt(hidden_size)`` (the scale rounded to the weights' dtype first);
- RMSNorm computed in float32 as ``x_normed * (1 + weight)``, rounded once at the end;
- four norms per layer: before and after attention, before and after the MLP (the "post"
  norms apply to the block's output, before the residual add);
- a GELU (tanh approximation) gated MLP; queries scaled by ``query_pre_attn_scalar**-0.5``;
- sliding-window and full layers (``ModelSpec.layer_window``), Gemma 2's soft caps on the
  attention scores and the final logits;
- Gemma 3: RMSNorm on each head's query and key, and a separate RoPE base for sliding layers.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from conveyor.engine.distributed.sharding import WeightSlot
from conveyor.engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm, RotaryEmbedding
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.models.multimodal import language_model_name


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class GemmaMLP(MLP):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device)
        self.approximate = "tanh" if spec.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.tp.row_parallel_linear(F.gelu(gate, approximate=self.approximate) * up, self.down_weight, None)


class GemmaAttention(Attention):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device)
        assert spec.query_pre_attn_scalar is not None  # (set for every Gemma config)
        self.scale = spec.query_pre_attn_scalar**-0.5
        self.softcap = spec.attn_logit_softcap
        if spec.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device)
            self.k_norm = GemmaRMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device, mlp=GemmaMLP(spec, dtype, device))
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.self_attn = GemmaAttention(spec, dtype, device)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(self, x, positions, rope, backend, kv_cache):
        h = self.self_attn(self.input_layernorm(x), positions, rope, backend, kv_cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, max_len, dtype, device)
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        # transformers multiplies by a float32 tensor cast to the weights' dtype.
        self.embed_scale = float(torch.tensor(spec.hidden_size**0.5).to(dtype))
        # Gemma 3's sliding layers turn with their own base and no scaling; the others with ``self.rope``.
        self.local_rope = self.rope
        if spec.local_rope_theta is not None:
            local = dataclasses.replace(spec, rope_theta=spec.local_rope_theta, rope_scaling={"rope_type": "default"})
            self.local_rope = RotaryEmbedding(local, max_len, dtype, device)

    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        return GemmaDecoderLayer(self.spec, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend, kv_caches) -> torch.Tensor:
        x = self.embed(input_ids) * self.embed_scale
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rope = self.local_rope if self.spec.layer_window(i) is not None else self.rope
            x = layer(x, positions, rope, backend, kv_cache)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def checkpoint_name(self, name: str) -> str | None:
        # (a multimodal checkpoint's language model: ``conveyor.engine.models.multimodal``)
        text = language_model_name(name)
        return None if text is None else super().checkpoint_name(text)

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = super().weight_slots()
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, GemmaDecoderLayer)  # (for the type checker)
            p = f"model.layers.{i}."
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                slots[f"{p}{name}.weight"] = (getattr(layer, name).weight, 0, self.spec.hidden_size)
        return slots
