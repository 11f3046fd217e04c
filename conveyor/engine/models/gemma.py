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
import functools
from typing import Any

import torch
import torch.nn.functional as F

from conveyor.engine.distributed.sharding import WeightSlot
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.layers import MLP, Attention, DecoderLayer, RMSNorm, RotaryEmbedding
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec, decoder_spec, sliding_per_layer
from conveyor.engine.models.multimodal import gemma_language_model_config, language_model_name


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


# Gemma's MLP activations (``hidden_activation``) we implement.
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Gemma's fields (``gemma_fields``); Gemma 3's q/k norm and its sliding layers' RoPE base
    (its full layers' RoPE read from ``_gemma3_rope``'s config)."""
    cfg = config.values
    fields = gemma_fields(cfg)
    if cfg["model_type"] == "gemma3_text":
        local_theta, full_rope = _gemma3_rope(cfg)
        return decoder_spec(config, rope_config=full_rope, local_rope_theta=local_theta, qk_norm=True, **fields)
    return decoder_spec(config, **fields)


def gemma_fields(cfg: dict) -> dict[str, Any]:
    """What a Gemma 2/3/4 config adds to Llama's (``ModelSpec`` documents each field), and
    which layers slide: per ``layer_types``, else the older ``sliding_window_pattern`` (every
    n-th layer is full)."""
    model_type = cfg["model_type"]
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported; supported: {GEMMA_ACTIVATIONS}")
    final_cap = cfg.get("final_logit_softcapping")
    attn_cap = cfg.get("attn_logit_softcapping")
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6))
    return {
        "hidden_act": act,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        # (transformers' Gemma 3 attention never passes its attn_logit_softcapping on)
        "attn_logit_softcap": float(attn_cap) if attn_cap and model_type == "gemma2" else None,
        "final_logit_softcap": float(final_cap) if final_cap else None,
        **sliding_per_layer(
            cfg, lambda: ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        ),
    }


def _gemma3_rope(cfg: dict) -> tuple[float, dict]:
    """Gemma 3's RoPE: the sliding layers' base (default RoPE) and a config holding the full
    layers' RoPE in the spelling ``read_rope`` reads. transformers 5.x writes one
    ``rope_parameters`` entry per layer type; 4.x wrote ``rope_theta`` and ``rope_scaling`` for
    the full layers and ``rope_local_base_freq`` for the sliding ones."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 sliding layers' rope type {local['rope_type']!r} is not supported")
        full = dict(params["full_attention"])
        full.setdefault("rope_theta", 1_000_000.0)
        return float(local.get("rope_theta", 10_000.0)), {"rope_parameters": full}
    return float(cfg.get("rope_local_base_freq", 10_000.0)), {
        "rope_theta": cfg.get("rope_theta", 1_000_000.0),
        "rope_scaling": cfg.get("rope_scaling"),
    }


# The released multimodal Gemma 3 checkpoints (``Gemma3ForConditionalGeneration``) serve their
# language model (``conveyor.engine.models.multimodal``).
FAMILY = Family(
    architectures=(
        Architecture("Gemma2ForCausalLM", "gemma2", GemmaForCausalLM),
        Architecture("Gemma3ForCausalLM", "gemma3_text", GemmaForCausalLM),
    ),
    read_config=read_config,
    wrappers={"gemma3": functools.partial(gemma_language_model_config, architecture="Gemma3ForCausalLM")},
)
