"""What a Gemma 4 text config (``gemma4_text``) adds to ``ModelSpec``, read apart so that the
config reader stays one line per family (``conveyor.engine.models.gemma4`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gemma4Spec:
    """Per layer kind, KV heads and head size (full layers may have their own:
    ``num_global_key_value_heads``, ``global_head_dim``); RoPE per kind (``proportional`` turns
    only ``partial_rotary_factor`` of the head's frequencies); ``attention_k_eq_v``: full
    layers take V from the key projection; the last ``num_kv_shared_layers`` layers read the KV
    of the last earlier layer of their kind; per-layer input embeddings of
    ``hidden_size_per_layer_input`` (0: none); ``use_double_wide_mlp``: shared-KV layers' MLP is
    twice as wide."""

    sliding_kv_heads: int
    sliding_head_dim: int
    full_kv_heads: int
    full_head_dim: int
    sliding_rope: dict
    full_rope: dict
    attention_k_eq_v: bool
    num_kv_shared_layers: int
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    use_double_wide_mlp: bool
    layer_types: tuple[str, ...]
    # ``enable_moe_block``: beside every layer's MLP, ``num_experts`` GELU experts (0: none).
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    @classmethod
    def from_config(cls, cfg: dict) -> Gemma4Spec:
        layers = int(cfg["num_hidden_layers"])
        types = list(cfg.get("layer_types") or [])
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        heads, head_dim = int(cfg["num_key_value_heads"]), int(cfg.get("head_dim") or 256)
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        global_heads = cfg.get("num_global_key_value_heads") if k_eq_v else None
        global_dim = int(cfg.get("global_head_dim") or 512)
        # A published config names the full layers' shape; transformers 5.x saves it per layer.
        per_layer = cfg.get("per_layer_config")
        if isinstance(per_layer, dict) and per_layer:
            full = {
                (int(o.get("num_key_value_heads", heads)), int(o.get("head_dim", head_dim))) for o in per_layer.values()
            }
            if len(full) != 1 or {types[int(i)] for i in per_layer} != {"full_attention"}:
                raise ValueError(
                    "gemma4_text: per_layer_config other than one shape for the full layers is not supported"
                )
            global_heads, global_dim = full.pop()
        rope = cfg.get("rope_parameters") or {}
        sliding_rope = dict(rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0})
        full_rope = dict(
            rope.get("full_attention")
            or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}
        )
        for kind, params in (("sliding_attention", sliding_rope), ("full_attention", full_rope)):
            if params.get("rope_type", "default") not in ("default", "proportional"):
                raise ValueError(f"gemma4_text {kind} rope type {params['rope_type']!r} is not supported")
        shared = int(cfg.get("num_kv_shared_layers") or 0)
        if shared and set(types[: layers - shared]) != set(types):
            raise ValueError("gemma4_text: a layer kind read by shared-KV layers has no earlier layer storing it")
        return cls(
            sliding_kv_heads=heads,
            sliding_head_dim=head_dim,
            full_kv_heads=int(global_heads) if global_heads else heads,
            full_head_dim=global_dim,
            sliding_rope=sliding_rope,
            full_rope=full_rope,
            attention_k_eq_v=k_eq_v,
            num_kv_shared_layers=shared,
            hidden_size_per_layer_input=int(cfg.get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]),
            use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
            layer_types=tuple(types),
            num_experts=int(cfg["num_experts"]) if cfg.get("enable_moe_block") else 0,
            top_k_experts=int(cfg.get("top_k_experts") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        )

    def kv_shape(self, layer_type: str) -> tuple[int, int]:
        if layer_type == "full_attention":
            return self.full_kv_heads, self.full_head_dim
        return self.sliding_kv_heads, self.sliding_head_dim

    def kv_source(self, index: int) -> int:
        """The layer whose KV layer ``index`` attends to: its own, or for a shared-KV layer the
        last layer of its kind before the shared ones."""
        first_shared = len(self.layer_types) - self.num_kv_shared_layers
        if index < first_shared:
            return index
        kind = self.layer_types[index]
        return max(i for i in range(first_shared) if self.layer_types[i] == kind)

    def tensor_parallel_problems(self, world_size: int, slot: int) -> list[str]:
        """What does not split over ``world_size`` ranks (``check_tensor_parallel``): each layer
        kind's KV heads, whose share on a rank must also fit the cache's per-rank token slot of
        ``slot`` values (sized from the larger kind), and the MoE block's experts."""
        problems = []
        for kind in sorted(set(self.layer_types)):
            heads, dim = self.kv_shape(kind)
            if heads % world_size and world_size % heads:
                problems.append(f"{kind} layers' KV heads {heads}")
            elif max(1, heads // world_size) * dim > slot:  # (a rank's KV heads: ``local_kv_heads``)
                problems.append(f"{kind} layers' KV heads {heads} of {dim} (a rank's share outgrows the cache slot)")
        if self.num_experts and self.moe_intermediate_size % world_size:
            problems.append(f"moe_intermediate_size {self.moe_intermediate_size}")
        return problems
