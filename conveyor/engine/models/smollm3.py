"""SmolLM3 (``SmolLM3ForCausalLM``): the Llama layers, with RoPE left out of the layers
``no_rope_layers`` marks 0 (NoPE layers: their queries and keys are not turned), as
transformers' ``modeling_smollm3`` does; with ``use_sliding_window``, sliding layers per
``layer_types`` (``ModelSpec.layer_window``)."""

from __future__ import annotations

import torch

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec, decoder_spec, sliding_per_layer


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


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Which layers turn with RoPE; with ``use_sliding_window``, sliding layers per
    ``layer_types`` (transformers' default: the NoPE layers slide); o_proj biased with q/k/v."""
    cfg = config.values
    rope_layers = _rope_layers(cfg)
    windows = {}
    if cfg.get("use_sliding_window"):
        windows = sliding_per_layer(
            cfg, lambda: ["full_attention" if rope else "sliding_attention" for rope in rope_layers]
        )
    return decoder_spec(config, o_bias=bool(cfg.get("attention_bias", False)), rope_layers=rope_layers, **windows)


def _rope_layers(cfg: dict) -> tuple[bool, ...]:
    """``no_rope_layers`` (1: the layer uses RoPE), or transformers' default from
    ``no_rope_layer_interval`` (every n-th layer is NoPE)."""
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(bool(f) for f in flags)


FAMILY = Family(
    architectures=(Architecture("SmolLM3ForCausalLM", "smollm3", SmolLM3ForCausalLM),), read_config=read_config
)
