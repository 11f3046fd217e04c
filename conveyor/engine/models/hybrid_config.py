"""What a hybrid model's config adds: which layers are gated DeltaNet linear attention (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next) and their shapes; and a multimodal Qwen3.5's language model config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Per layer whether it is linear attention (``linear_layers``, the rest are gated full
    attention on the paged KV cache), and the linear layers' shapes: ``num_k_heads`` query/key
    heads of ``k_head_dim``, ``num_v_heads`` value heads of ``v_head_dim`` (each query/key head
    serves ``num_v_heads // num_k_heads`` consecutive value heads), a causal depthwise conv of
    ``conv_kernel`` taps over the concatenated q, k, v."""

    linear_layers: tuple[bool, ...]
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int

    @classmethod
    def from_config(cls, cfg: dict) -> LinearAttentionSpec:
        layers = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0 else "linear_attention"
            for i in range(layers)
        ]
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        unknown = set(types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported (linear_attention, full_attention)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for {cfg['model_type']} (silu)")
        spec = cls(
            linear_layers=tuple(t == "linear_attention" for t in types),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
            num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
            k_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            v_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        )
        if spec.num_v_heads % spec.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {spec.num_v_heads} is not a multiple of "
                f"linear_num_key_heads {spec.num_k_heads}"
            )
        return spec

    def tensor_parallel_problems(self, world_size: int) -> list[str]:
        """What does not split over ``world_size`` ranks (``check_tensor_parallel``): a rank keeps
        whole key heads and the value heads grouped with them."""
        return [f"linear_num_key_heads {self.num_k_heads}"] if self.num_k_heads % world_size else []

    def rank_share(self, world_size: int) -> LinearAttentionSpec:
        """The shapes one of ``world_size`` tensor-parallel ranks holds: its share of the key
        heads and of the value heads (each key head with its ``num_v_heads // num_k_heads``)."""
        if world_size == 1:
            return self
        return dataclasses.replace(
            self, num_k_heads=self.num_k_heads // world_size, num_v_heads=self.num_v_heads // world_size
        )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def num_linear_layers(self) -> int:
        return sum(self.linear_layers)

    def state_bytes(self, conv_elem_bytes: int) -> int:
        """One request's state over all linear layers: the conv's last ``conv_kernel - 1``
        inputs (in the model's dtype) and the float32 recurrent state ``[v heads, dk, dv]``."""
        conv = self.conv_dim * (self.conv_kernel - 1) * conv_elem_bytes
        recurrent = self.num_v_heads * self.k_head_dim * self.v_head_dim * 4
        return self.num_linear_layers * (conv + recurrent)


def text_model_config(cfg: dict, architecture: str) -> dict:
    """A multimodal Qwen3.5 config (``text_config`` inside) as its language model's config,
    run by ``architecture``."""
    out = dict(cfg["text_config"])
    out["model_type"] = str(cfg["model_type"]) + "_text"
    out["architectures"] = [architecture]
    out["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", out.get("tie_word_embeddings", False)))
    for key in ("eos_token_id", "dtype", "torch_dtype"):
        if out.get(key) is None and cfg.get(key) is not None:
            out[key] = cfg[key]
    return out
