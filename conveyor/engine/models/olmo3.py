"""OLMo 3 (``Olmo3ForCausalLM``): the Llama layers with OLMo 3's differences, each following
transformers' ``modeling_olmo3``:

- no norm before attention or the MLP: each block's output is normed (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) before the residual add;
- RMSNorm on the query and key projections over all heads at once (not per head), before
  RoPE; under tensor parallelism the sum of squares is added up over the ranks;
- sliding-window and full layers per ``layer_types``, the sliding layers with RoPE of their own
  (default, ``local_rope_theta``), the full ones with the configured one (YaRN in the released
  long-context models); cos/sin kept in float32 and the rotation computed in it;
- norms in float32, multiplied by the weight before rounding (as gpt-oss's).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.distributed.sharding import Shard, WeightSlot
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.gpt_oss import GptOssRMSNorm
from conveyor.engine.models.layers import Attention, DecoderLayer, RotaryEmbedding, _param
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec, decoder_spec, sliding_per_layer


class Olmo3Attention(Attention):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device)
        # Over this rank's heads' slice of the whole projection.
        self.q_norm_weight = _param(self.q_size, dtype=dtype, device=device)
        self.k_norm_weight = _param(self.kv_size, dtype=dtype, device=device)
        self.eps = spec.rms_norm_eps

    def _wide_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.tp.enabled:
            # Every rank holds the same number of dims (a replicated KV head is counted on each
            # rank that holds it, as often as every other), so this is the mean over all heads.
            mean = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / (x.shape[-1] * self.tp.world_size)
        else:
            mean = xf.pow(2).mean(-1, keepdim=True)
        return (weight.float() * (xf * torch.rsqrt(mean + self.eps))).to(x.dtype)

    def forward(self, x, positions, rope, backend: AttentionBackend, kv_cache):
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._wide_norm(q, self.q_norm_weight).view(-1, self.num_heads, self.head_dim)
        k = self._wide_norm(k, self.k_norm_weight).view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qr, kr = rope(positions, q, k)  # (float32 cos/sin: the rotation runs in float32)
        out = backend.forward(
            qr.to(q.dtype), kr.to(k.dtype), v, kv_cache[0], kv_cache[1], self.scale, sliding_window=self.sliding_window
        )
        return self.tp.row_parallel_linear(out.reshape(-1, self.q_size), self.o_weight, self.o_bias)


class Olmo3DecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device)
        self.self_attn = Olmo3Attention(spec, dtype, device)
        self.post_attention_layernorm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_feedforward_layernorm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(self, x, positions, rope, backend, kv_cache):
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, rope, backend, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo3ForCausalLM(LlamaForCausalLM):
    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, max_len, dtype, device)
        self.norm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.rope = RotaryEmbedding(spec, max_len, torch.float32, device)
        self.local_rope = self.rope
        if spec.local_rope_theta is not None:
            local = dataclasses.replace(spec, rope_theta=spec.local_rope_theta, rope_scaling={"rope_type": "default"})
            self.local_rope = RotaryEmbedding(local, max_len, torch.float32, device)

    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        return Olmo3DecoderLayer(self.spec, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend: AttentionBackend, kv_caches) -> torch.Tensor:
        x = self.embed(input_ids)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rope = self.local_rope if self.spec.layer_window(i) is not None else self.rope
            x = layer(x, positions, rope, backend, kv_cache)
        return self.norm(x)

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = super().weight_slots()
        d = self.spec.head_dim
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Olmo3DecoderLayer)  # (for the type checker)
            p, a = f"model.layers.{i}.", layer.self_attn
            assert isinstance(a, Olmo3Attention)
            del slots[p + "input_layernorm.weight"]  # (OLMo 3 has none)
            heads = a.heads
            slots[p + "self_attn.q_norm.weight"] = (
                a.q_norm_weight,
                0,
                a.q_size,
                Shard.rows(heads.head_start * d, a.q_size),
            )
            slots[p + "self_attn.k_norm.weight"] = (
                a.k_norm_weight,
                0,
                a.kv_size,
                Shard.rows(heads.kv_head_start * d, a.kv_size),
            )
            slots[p + "post_feedforward_layernorm.weight"] = (
                layer.post_feedforward_layernorm.weight,
                0,
                self.spec.hidden_size,
            )
        return slots


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Sliding and full layers per ``layer_types`` (transformers' default: every 4th layer
    full), the sliding layers' RoPE base in ``local_rope_theta`` (as Gemma 3's), o_proj biased
    with q/k/v."""
    cfg = config.values
    local_theta, full_rope = _rope(cfg)
    layers = int(cfg["num_hidden_layers"])
    return decoder_spec(
        config,
        rope_config=full_rope,
        local_rope_theta=local_theta,
        o_bias=bool(cfg.get("attention_bias", False)),
        **sliding_per_layer(
            cfg, lambda: ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
        ),
    )


def _rope(cfg: dict) -> tuple[float, dict]:
    """The sliding layers' RoPE base (default RoPE) and a config holding the full layers' RoPE
    in the spelling ``read_rope`` reads. transformers 5.x writes one ``rope_parameters`` entry
    per layer type; 4.x wrote ``rope_theta`` for both and ``rope_scaling`` for the full layers
    only."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local, full = dict(params.get("sliding_attention") or {}), dict(params["full_attention"])
    else:
        theta = cfg.get("rope_theta", 500_000.0)
        local, full = {"rope_theta": theta}, {**(cfg.get("rope_scaling") or {}), "rope_theta": theta}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"OLMo 3 sliding layers' rope type {local['rope_type']!r} is not supported")
    full.setdefault("rope_theta", 500_000.0)
    # (what a YaRN factor left out is derived from)
    lengths = {k: cfg[k] for k in ("max_position_embeddings", "original_max_position_embeddings") if cfg.get(k)}
    return float(local.get("rope_theta", 500_000.0)), {"rope_parameters": full, **lengths}


FAMILY = Family(architectures=(Architecture("Olmo3ForCausalLM", "olmo3", Olmo3ForCausalLM),), read_config=read_config)
