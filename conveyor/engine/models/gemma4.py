"""Gemma 4 text models (``Gemma4ForCausalLM``, dense), following transformers' ``gemma4``
modules:

- RMSNorm as ``x * (mean(x^2) + eps)^-0.5 * weight`` in float32 (the weight itself, not
  Gemma 2/3's ``1 + weight``); q and k normed per head, v normed without a weight; attention
  scale 1;
- sliding and full layers with their own KV heads, head size and RoPE (the full layers'
  ``proportional`` RoPE turns only part of the frequencies); with ``attention_k_eq_v`` a full
  layer's V is its key projection (normed apart, unrotated);
- shared KV: the last ``num_kv_shared_layers`` layers compute no K/V and own no cache; each
  attends over the cache of the last earlier layer of its kind (``Gemma4Spec.kv_source``),
  handing the backend that layer's K/V of this step, which the write leaves as it was;
- per-layer input embeddings: a packed per-layer embedding of each token plus a projection of
  the scaled embedding, mixed into the residual after each layer's MLP through a GELU gate;
- a per-layer scalar on the output, final logit soft cap, tied embeddings.
- tensor parallelism: query heads and each kind's KV heads split (``head_shard`` per kind), the
  MLP's and the experts' intermediate dims split, the per-layer inputs whole on every rank.

The cache holds one K/V shape per layer (``ModelSpec.num_kv_heads``/``head_dim``, the larger
kind's); a layer of the smaller kind uses the first part of each token's slot.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.sharding import Shard, WeightSlot, head_shard, split, vocab_shard
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.gemma import gemma_fields
from conveyor.engine.models.gemma4_spec import Gemma4Spec
from conveyor.engine.models.layers import RMSNorm, _param
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec, decoder_spec
from conveyor.engine.models.moe import moe_sorted
from conveyor.engine.models.multimodal import gemma_language_model_config, language_model_name


def gemma4_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(x)


class Gemma4Norm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma4_rms_norm(x, self.weight, self.eps)


class Gemma4Rotary(nn.Module):
    """cos/sin per position for one layer kind, over the whole head (``proportional``: the
    frequencies past ``partial_rotary_factor`` are zero, so those dims pass unturned)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, params: dict, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        base = float(params.get("rope_theta", 10_000.0))
        if params.get("rope_type", "default") == "proportional":
            angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
            rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
            inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))
            inv_freq = inv_freq / float(params.get("factor", 1.0))
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _cache_view(cache: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``[blocks, block_size, H, D]`` of the first ``heads * head_dim`` of each token's slot."""
    blocks, block_size = cache.shape[0], cache.shape[1]
    if cache.shape[2:] == (heads, head_dim):
        return cache
    return cache.view(blocks, block_size, -1)[..., : heads * head_dim].view(blocks, block_size, heads, head_dim)


class Gemma4Attention(nn.Module):
    def __init__(self, spec: ModelSpec, g4: Gemma4Spec, index: int, dtype, device) -> None:
        super().__init__()
        self.layer_type = g4.layer_types[index]
        self.sliding_window = spec.sliding_window if self.layer_type == "sliding_attention" else None
        kv_heads, self.head_dim = g4.kv_shape(self.layer_type)
        # Under tensor parallelism, this rank's query heads and its KV heads of this layer's kind.
        self.tp = parallel_state.current()
        self.heads = head_shard(spec.num_heads, kv_heads, self.tp)
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        self.shared = g4.kv_source(index) != index
        self.k_eq_v = g4.attention_k_eq_v and self.layer_type == "full_attention"
        hidden, eps, bias = spec.hidden_size, spec.rms_norm_eps, spec.qkv_bias
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_weight = _param(q, hidden, dtype=dtype, device=device)
        self.q_bias = _param(q, dtype=dtype, device=device) if bias else None
        self.q_norm = Gemma4Norm(self.head_dim, eps, dtype, device)
        self.eps = eps
        if not self.shared:
            self.k_weight = _param(kv, hidden, dtype=dtype, device=device)
            self.k_bias = _param(kv, dtype=dtype, device=device) if bias else None
            self.k_norm = Gemma4Norm(self.head_dim, eps, dtype, device)
            if not self.k_eq_v:
                self.v_weight = _param(kv, hidden, dtype=dtype, device=device)
                self.v_bias = _param(kv, dtype=dtype, device=device) if bias else None
        self.o_weight = _param(hidden, q, dtype=dtype, device=device)
        self.o_bias = _param(hidden, dtype=dtype, device=device) if bias else None

    def forward(self, x, positions, rope: Gemma4Rotary, backend: AttentionBackend, kv_cache, shared_kv: dict):
        q = self.q_norm(F.linear(x, self.q_weight, self.q_bias).view(-1, self.num_heads, self.head_dim))
        q = rope(positions, q)
        if self.shared:
            k, v = shared_kv[self.layer_type]
        else:
            k_raw = F.linear(x, self.k_weight, self.k_bias).view(-1, self.num_kv_heads, self.head_dim)
            v_raw = k_raw if self.k_eq_v else F.linear(x, self.v_weight, self.v_bias).view(k_raw.shape)
            k = rope(positions, self.k_norm(k_raw))
            v = gemma4_rms_norm(v_raw, None, self.eps)
            shared_kv[self.layer_type] = (k, v)
        k_cache = _cache_view(kv_cache[0], self.num_kv_heads, self.head_dim)
        v_cache = _cache_view(kv_cache[1], self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, k_cache, v_cache, 1.0, sliding_window=self.sliding_window)
        return self.tp.row_parallel_linear(out.reshape(-1, self.num_heads * self.head_dim), self.o_weight, self.o_bias)


class Gemma4MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, approximate: str, dtype, device) -> None:
        super().__init__()
        self.tp = parallel_state.current()
        self.inter_start, self.inter = split(inter, self.tp)  # (this rank's slice)
        self.approximate = approximate
        inter = self.inter
        self.gate_up_weight = _param(2 * inter, hidden, dtype=dtype, device=device)
        self.down_weight = _param(hidden, inter, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.tp.row_parallel_linear(F.gelu(gate, approximate=self.approximate) * up, self.down_weight, None)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Gemma4MoE(nn.Module):
    """The experts beside a layer's MLP (``enable_moe_block``): routed from the layer's
    residual (weightless norm, a learnt scale, ``hidden**-0.5``), softmax in float32, top-k
    renormalised and times each expert's learnt scale; the experts (GELU, token-sorted
    ``moe_sorted``) run on their own pre-norm and their sum is post-normed."""

    def __init__(self, spec: ModelSpec, g4: Gemma4Spec, dtype, device) -> None:
        super().__init__()
        e, hidden, eps = g4.num_experts, spec.hidden_size, spec.rms_norm_eps
        # Under tensor parallelism, this rank's slice of every expert's intermediate dim.
        self.tp = parallel_state.current()
        self.inter_start, self.inter = split(g4.moe_intermediate_size, self.tp)
        self.full_inter, inter = g4.moe_intermediate_size, self.inter
        self.top_k, self.eps, self.hidden = g4.top_k_experts, eps, hidden
        self.router_proj = _param(e, hidden, dtype=dtype, device=device)
        self.router_scale = _param(hidden, dtype=dtype, device=device)
        self.per_expert_scale = _param(e, dtype=dtype, device=device)
        self.gate_up = _param(e, 2 * inter, hidden, dtype=dtype, device=device)
        self.down = _param(e, hidden, inter, dtype=dtype, device=device)
        self.pre_feedforward_layernorm_2 = Gemma4Norm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm_2 = Gemma4Norm(hidden, eps, dtype, device)

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        h = gemma4_rms_norm(residual, None, self.eps) * self.router_scale * self.hidden**-0.5
        probs = torch.softmax(F.linear(h, self.router_proj), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids]
        x = self.pre_feedforward_layernorm_2(residual)
        out = moe_sorted(x, self.gate_up, self.down, weights, ids, gelu_tanh_and_mul)
        return self.post_feedforward_layernorm_2(self.tp.all_reduce(out))  # (the ranks' partial sums)


class Gemma4Layer(nn.Module):
    def __init__(self, spec: ModelSpec, g4: Gemma4Spec, index: int, dtype, device) -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.approximate = "tanh" if spec.hidden_act == "gelu_pytorch_tanh" else "none"
        self.self_attn = Gemma4Attention(spec, g4, index, dtype, device)
        wide = 2 if g4.use_double_wide_mlp and self.self_attn.shared else 1
        self.mlp = Gemma4MLP(hidden, spec.intermediate_size * wide, self.approximate, dtype, device)
        self.input_layernorm = Gemma4Norm(hidden, eps, dtype, device)
        self.post_attention_layernorm = Gemma4Norm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = Gemma4Norm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm = Gemma4Norm(hidden, eps, dtype, device)
        self.layer_scalar = _param(1, dtype=dtype, device=device)
        self.moe = Gemma4MoE(spec, g4, dtype, device) if g4.num_experts else None
        if self.moe is not None:
            self.post_feedforward_layernorm_1 = Gemma4Norm(hidden, eps, dtype, device)
        self.ple = g4.hidden_size_per_layer_input
        if self.ple:
            self.per_layer_input_gate = _param(self.ple, hidden, dtype=dtype, device=device)
            self.per_layer_projection = _param(hidden, self.ple, dtype=dtype, device=device)
            self.post_per_layer_input_norm = Gemma4Norm(hidden, eps, dtype, device)

    def forward(self, x, per_layer_input, positions, rope, backend, kv_cache, shared_kv):
        h = self.self_attn(self.input_layernorm(x), positions, rope, backend, kv_cache, shared_kv)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:
            h = self.post_feedforward_layernorm_1(h) + self.moe(x)
        x = x + self.post_feedforward_layernorm(h)
        if self.ple:
            gate = F.gelu(F.linear(x, self.per_layer_input_gate), approximate=self.approximate)
            x = x + self.post_per_layer_input_norm(F.linear(gate * per_layer_input, self.per_layer_projection))
        return x * self.layer_scalar


class Gemma4ForCausalLM(LlamaForCausalLM):
    # (the Llama layers' CUDA-graph capture has not been checked with per-kind cache views)
    supports_cuda_graphs = False

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        # (the Llama model's constructor is not run: its layers and RoPE are not Gemma 4's)
        nn.Module.__init__(self)
        g4 = spec.gemma4
        if g4 is None:
            raise ValueError(f"{spec.architecture} needs the config's Gemma 4 fields")
        self.spec, self.g4 = spec, g4
        self.tp = parallel_state.current()
        hidden = spec.hidden_size
        # (vocabulary-parallel embedding and LM head, as the Llama layers': ``embed``, ``compute_logits``)
        self.vocab = vocab = vocab_shard(spec.vocab_size, self.tp)
        self.embed_tokens = _param(vocab.padded, hidden, dtype=dtype, device=device)
        self.embed_tokens.data[vocab.rows :].zero_()
        self.layers = nn.ModuleList(Gemma4Layer(spec, g4, i, dtype, device) for i in range(spec.num_layers))
        tied = spec.tie_word_embeddings
        self.lm_head = self.embed_tokens if tied else _param(vocab.padded, hidden, dtype=dtype, device=device)
        self.lm_head.data[vocab.rows :].zero_()
        self.norm = Gemma4Norm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.embed_scale = float(torch.tensor(spec.hidden_size**0.5).to(dtype))
        self.ropes = nn.ModuleDict(
            {
                "sliding_attention": Gemma4Rotary(g4.sliding_rope, g4.sliding_head_dim, max_len, dtype, device),
                "full_attention": Gemma4Rotary(g4.full_rope, g4.full_head_dim, max_len, dtype, device),
            }
        )
        ple, layers = g4.hidden_size_per_layer_input, spec.num_layers
        if ple:
            self.embed_tokens_per_layer = _param(
                g4.vocab_size_per_layer_input, layers * ple, dtype=dtype, device=device
            )
            self.ple_scale = float(torch.tensor(ple**0.5).to(dtype))
            self.per_layer_model_projection = _param(layers * ple, spec.hidden_size, dtype=dtype, device=device)
            self.per_layer_projection_norm = Gemma4Norm(ple, spec.rms_norm_eps, dtype, device)

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        layers, ple = self.spec.num_layers, self.g4.hidden_size_per_layer_input
        tokens = F.embedding(input_ids, self.embed_tokens_per_layer) * self.ple_scale
        projected = F.linear(x, self.per_layer_model_projection) * self.spec.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(-1, layers, ple))
        return (projected + tokens.view(-1, layers, ple)) * 2.0**-0.5

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend, kv_caches) -> torch.Tensor:
        x = self.embed(input_ids) * self.embed_scale
        per_layer = self._per_layer_inputs(input_ids, x) if self.g4.hidden_size_per_layer_input else None
        shared_kv: dict = {}
        for i, layer in enumerate(self.layers):
            kind = self.g4.layer_types[i]
            cache = kv_caches[self.g4.kv_source(i)]
            pli = per_layer[:, i] if per_layer is not None else None
            x = layer(x, pli, positions, self.ropes[kind], backend, cache, shared_kv)
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
        spec, g4, hidden = self.spec, self.g4, self.spec.hidden_size
        vocab = Shard.rows(self.vocab.start, self.vocab.rows)
        slots: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, self.vocab.rows, vocab),
            "model.norm.weight": (self.norm.weight, 0, hidden),
        }
        if not spec.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, 0, self.vocab.rows, vocab)
        ple = g4.hidden_size_per_layer_input
        if ple:
            slots["model.embed_tokens_per_layer.weight"] = (
                self.embed_tokens_per_layer,
                0,
                g4.vocab_size_per_layer_input,
            )
            slots["model.per_layer_model_projection.weight"] = (
                self.per_layer_model_projection,
                0,
                spec.num_layers * ple,
            )
            slots["model.per_layer_projection_norm.weight"] = (self.per_layer_projection_norm.weight, 0, ple)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Gemma4Layer)  # (for the type checker)
            p, a = f"model.layers.{i}.", layer.self_attn
            d, heads = a.head_dim, a.heads
            q_rows = Shard.rows(heads.head_start * d, heads.num_heads * d)
            kv_rows = Shard.rows(heads.kv_head_start * d, heads.num_kv_heads * d)
            for name, tensor in a.named_parameters(recurse=False):
                kind, part = name.split("_")
                proj = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}[kind]
                shard = {"q": q_rows, "k": kv_rows, "v": kv_rows}.get(kind)
                if kind == "o":  # (its input columns are this rank's heads'; its bias is added once)
                    shard = Shard.cols(heads.head_start * d, heads.num_heads * d) if part == "weight" else None
                slot = (tensor, 0, tensor.shape[0])
                slots[f"{p}self_attn.{proj}.{part}"] = slot if shard is None else (*slot, shard)
            slots[f"{p}self_attn.q_norm.weight"] = (a.q_norm.weight, 0, a.head_dim)
            if not a.shared:
                slots[f"{p}self_attn.k_norm.weight"] = (a.k_norm.weight, 0, a.head_dim)
            m = layer.mlp
            inter_rows = Shard.rows(m.inter_start, m.inter)
            slots[f"{p}mlp.gate_proj.weight"] = (m.gate_up_weight, 0, m.inter, inter_rows)
            slots[f"{p}mlp.up_proj.weight"] = (m.gate_up_weight, m.inter, m.inter, inter_rows)
            slots[f"{p}mlp.down_proj.weight"] = (m.down_weight, 0, hidden, Shard.cols(m.inter_start, m.inter))
            for name, norm in layer.named_children():
                if isinstance(norm, Gemma4Norm):
                    slots[f"{p}{name}.weight"] = (norm.weight, 0, hidden)
            slots[f"{p}layer_scalar"] = (layer.layer_scalar, 0, 1)
            if layer.moe is not None:
                moe, experts = layer.moe, self.g4.num_experts
                slots[f"{p}router.proj.weight"] = (moe.router_proj, 0, experts)
                slots[f"{p}router.scale"] = (moe.router_scale, 0, hidden)
                slots[f"{p}router.per_expert_scale"] = (moe.per_expert_scale, 0, experts)
                # (gate rows then up rows: this rank's slice of each)
                start, inter = moe.inter_start, moe.inter
                gate_up = Shard(1, ((start, inter), (moe.full_inter + start, inter)))
                slots[f"{p}experts.gate_up_proj"] = (moe.gate_up, 0, experts, gate_up)
                slots[f"{p}experts.down_proj"] = (moe.down, 0, experts, Shard(2, ((start, inter),)))
                for name in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
                    slots[f"{p}{name}.weight"] = (getattr(moe, name).weight, 0, hidden)
            if layer.ple:
                slots[f"{p}per_layer_input_gate.weight"] = (layer.per_layer_input_gate, 0, ple)
                slots[f"{p}per_layer_projection.weight"] = (layer.per_layer_projection, 0, hidden)
                slots[f"{p}post_per_layer_input_norm.weight"] = (layer.post_per_layer_input_norm.weight, 0, hidden)
        return slots


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Gemma's fields (``gemma.gemma_fields``) and Gemma 4's own (``Gemma4Spec``); the cache's
    per-token slot is the shape of the layer kind whose K/V is larger."""
    fields = gemma_fields(config.values)
    g4 = Gemma4Spec.from_config(config.values)
    shapes = (g4.kv_shape("sliding_attention"), g4.kv_shape("full_attention"))
    kv_heads, head_dim = max(shapes, key=lambda shape: shape[0] * shape[1])
    return decoder_spec(config, gemma4=g4, num_kv_heads=kv_heads, head_dim=head_dim, **fields)


# The released multimodal checkpoints (``Gemma4ForConditionalGeneration``) serve their language
# model (``conveyor.engine.models.multimodal``).
FAMILY = Family(
    architectures=(Architecture("Gemma4ForCausalLM", "gemma4_text", Gemma4ForCausalLM),),
    read_config=read_config,
    wrappers={"gemma4": functools.partial(gemma_language_model_config, architecture="Gemma4ForCausalLM")},
)
