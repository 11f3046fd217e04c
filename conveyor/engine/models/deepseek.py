"""DeepSeek-V3 (``DeepseekV3ForCausalLM`` with ``model_type`` ``deepseek_v3``), following
transformers' ``deepseek_v3`` modules: multi-head latent attention, dense first layers
(``first_k_dense_replace``), then MoE layers with shared experts and grouped top-k routing.

Attention (``LatentAttention``): the cache holds, per token and layer, the normalised latent
(``kv_lora_rank``) and the rope key (``qk_rope_head_dim``) every head shares
(``conveyor.engine.models.kv_layout``), not per-head keys and values. Prefill chunks decompress their
context through ``kv_b_proj`` into per-head keys and values, as transformers computes them.
Decode rows stay in the latent space: each head's no-rope query is absorbed through its key
projection (``q_nope @ W_UK``), scored against the cached rows directly, and the weighted
latent sum goes through the head's value projection (``W_UV``) afterwards; the backend's
``mla_decode`` (``conveyor.kernels.reference.mla_decode`` or the Triton kernel) does the middle part.

Routing (``moe.grouped_sigmoid_route``): sigmoid scores in float32; the experts are chosen by score plus
``e_score_correction_bias`` from the ``topk_group`` groups whose two best such scores sum
highest; their weights are the plain scores, renormalised with ``norm_topk_prob``, times
``routed_scaling_factor``. The shared experts (one MLP of ``n_shared_experts`` widths) are
added ungated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.sharding import Shard, WeightSlot, head_shard
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.grouped_sigmoid_moe import GroupedSigmoidMoE
from conveyor.engine.models.kv_layout import LayerCache
from conveyor.engine.models.layers import (
    MLP,
    DecoderLayer,
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    _param,
)
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import MLASpec, ModelSpec, MoESpec, decoder_spec
from conveyor.engine.models.yarn import yarn_mscale


class LatentAttention(nn.Module):
    """Multi-head latent attention over the latent cache (the module docstring says how)."""

    def __init__(self, spec: ModelSpec, mla: MLASpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.mla = mla
        # Under tensor parallelism, this rank's heads; the latent (and its cache) is whole on every rank.
        self.tp = parallel_state.current()
        self.heads = head_shard(spec.num_heads, spec.num_heads, self.tp)
        self.num_heads = h = self.heads.num_heads
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        hidden, rank = spec.hidden_size, mla.kv_lora_rank
        if mla.q_lora_rank is None:
            self.q_a_weight, self.q_a_norm = None, None
            self.q_b_weight = _param(h * self.qk_head_dim, hidden, dtype=dtype, device=device)
        else:
            self.q_a_weight = _param(mla.q_lora_rank, hidden, dtype=dtype, device=device)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, 1e-6, dtype, device)
            self.q_b_weight = _param(h * self.qk_head_dim, mla.q_lora_rank, dtype=dtype, device=device)
        self.kv_a_weight = _param(mla.latent_width, hidden, dtype=dtype, device=device)
        self.kv_a_norm = RMSNorm(rank, 1e-6, dtype, device)
        self.kv_b_weight = _param(h * (mla.qk_nope_head_dim + mla.v_head_dim), rank, dtype=dtype, device=device)
        self.o_weight = _param(hidden, h * mla.v_head_dim, dtype=dtype, device=device)

    def forward(self, x, positions, rope: RotaryEmbedding, backend: AttentionBackend, kv_cache: LayerCache):
        mla, h = self.mla, self.num_heads
        rank, nope, v_dim = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim
        q_in = x if self.q_a_weight is None or self.q_a_norm is None else self.q_a_norm(F.linear(x, self.q_a_weight))
        q = F.linear(q_in, self.q_b_weight).view(-1, h, self.qk_head_dim)
        q_nope, q_pe = q.split([nope, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = F.linear(x, self.kv_a_weight).split([rank, mla.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self._rope(rope, positions, q_pe, k_pe.unsqueeze(1))
        rows = torch.cat((self.kv_a_norm(latent), k_pe[:, 0]), dim=-1)  # [tokens, latent_width]
        cache = kv_cache[0]
        meta = backend.meta
        cache.view(-1, mla.latent_width).index_copy_(0, meta.slot_mapping.long(), rows)
        kv_b = self.kv_b_weight.view(h, nope + v_dim, rank)
        out = q.new_empty(q.shape[0], h, v_dim)
        nd = meta.num_decodes
        if nd:
            # Absorbed: q_nope through each head's key projection into the latent space.
            q_latent = torch.einsum("thn,hnr->thr", q_nope[:nd], kv_b[:, :nope])
            latent_out = backend.mla_decode(torch.cat((q_latent, q_pe[:nd]), dim=-1), cache, mla.softmax_scale, rank)
            out[:nd] = torch.einsum("thr,hvr->thv", latent_out, kv_b[:, nope:])
        start = nd
        for b in range(nd, len(meta.query_lens_host)):
            q_len, seq_len = meta.query_lens_host[b], meta.seq_lens_host[b]
            if seq_len == q_len:  # nothing cached before this chunk: its own rows are the context
                context = rows[start : start + q_len]
            else:
                blocks = meta.block_tables[b, : -(-seq_len // cache.shape[1])].long()
                context = cache[blocks].flatten(0, 2)[:seq_len]
            qb = torch.cat((q_nope[start : start + q_len], q_pe[start : start + q_len]), dim=-1)
            out[start : start + q_len] = self._prefill(qb, context, kv_b, seq_len)
            start += q_len
        return self.tp.row_parallel_linear(out.reshape(-1, h * v_dim), self.o_weight, None)

    def _prefill(self, q: torch.Tensor, context: torch.Tensor, kv_b: torch.Tensor, seq_len: int) -> torch.Tensor:
        """One prefill chunk's attention with its context decompressed into per-head keys and
        values (transformers' ``expand_kv``): ``q [q_len, heads, qk_head_dim]``, ``context
        [seq_len, latent_width]`` -> ``[q_len, heads, v_head_dim]``."""
        mla, h = self.mla, self.num_heads
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        kv = F.linear(context[:, :rank], kv_b.flatten(0, 1)).view(seq_len, h, nope + mla.v_head_dim)
        k_pe = context[:, rank:].unsqueeze(1).expand(seq_len, h, mla.qk_rope_head_dim)
        keys = torch.cat((kv[..., :nope], k_pe), dim=-1).transpose(0, 1)
        values = kv[..., nope:].transpose(0, 1)
        q_len = q.shape[0]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        visible = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=visible, scale=mla.softmax_scale)
        return o.transpose(0, 1)

    def _rope(
        self, rope: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the rope parts; DeepSeek's checkpoints pair the dimensions interleaved
        (``rope_interleave``: ``(x0, x1), (x2, x3)...`` each turned by one frequency)."""
        if not self.mla.rope_interleave:
            return rope(positions, q, k)
        half = rope.cos.shape[-1] // 2
        cos = rope.cos[positions, :half].unsqueeze(1)
        sin = rope.sin[positions, :half].unsqueeze(1)

        def turn(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        return turn(q), turn(k)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        mla, h, start = self.mla, self.num_heads, self.heads.head_start
        kv_rows = mla.qk_nope_head_dim + mla.v_head_dim
        q_rows = h * self.qk_head_dim
        q_shard = Shard.rows(start * self.qk_head_dim, q_rows)
        slots: dict[str, WeightSlot] = {
            f"{prefix}kv_a_proj_with_mqa.weight": (self.kv_a_weight, 0, mla.latent_width),
            f"{prefix}kv_a_layernorm.weight": (self.kv_a_norm.weight, 0, mla.kv_lora_rank),
            f"{prefix}kv_b_proj.weight": (self.kv_b_weight, 0, h * kv_rows, Shard.rows(start * kv_rows, h * kv_rows)),
            f"{prefix}o_proj.weight": (
                self.o_weight,
                0,
                self.o_weight.shape[0],
                Shard.cols(start * mla.v_head_dim, h * mla.v_head_dim),
            ),
        }
        if self.q_a_weight is None or self.q_a_norm is None:
            slots[f"{prefix}q_proj.weight"] = (self.q_b_weight, 0, q_rows, q_shard)
        else:
            rank = self.q_a_weight.shape[0]
            slots[f"{prefix}q_a_proj.weight"] = (self.q_a_weight, 0, rank)
            slots[f"{prefix}q_a_layernorm.weight"] = (self.q_a_norm.weight, 0, rank)
            slots[f"{prefix}q_b_proj.weight"] = (self.q_b_weight, 0, q_rows, q_shard)
        return slots


class DeepseekDecoderLayer(DecoderLayer):
    """A Llama decoder layer whose attention is ``LatentAttention``."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, mlp: FeedForward) -> None:
        nn.Module.__init__(self)
        assert spec.mla is not None
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = LatentAttention(spec, spec.mla, dtype, device)  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.mlp = mlp


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    # The prefill loop and the torch decode read lengths on the host: decode runs eagerly.
    supports_cuda_graphs = False

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        if spec.mla is None:
            raise ValueError(f"{spec.architecture} needs the config's latent-attention fields")
        super().__init__(spec, max_len, dtype, device)

    def skips_weight(self, name: str) -> bool:
        return self.beyond_last_layer(name)

    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        spec, moe = self.spec, self.spec.moe
        mlp: FeedForward
        if moe is not None and index in moe.sparse_layers:
            mlp = GroupedSigmoidMoE(spec, moe, dtype, device)
        else:
            mlp = MLP(spec, dtype, device)
        return DeepseekDecoderLayer(spec, dtype, device, mlp)

    def weight_slots(self) -> dict[str, WeightSlot]:
        spec, vocab = self.spec, self.vocab
        slots: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, vocab.rows, Shard.rows(vocab.start, vocab.rows)),
            "model.norm.weight": (self.norm.weight, 0, spec.hidden_size),
        }
        if not spec.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, 0, vocab.rows, Shard.rows(vocab.start, vocab.rows))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DeepseekDecoderLayer) and isinstance(layer.self_attn, LatentAttention)
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0, spec.hidden_size)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, spec.hidden_size)
            slots.update(layer.self_attn.weight_slots(p + "self_attn."))
            slots.update(layer.mlp.weight_slots(p + "mlp."))
        return slots


def read_config(config: CheckpointConfig) -> ModelSpec:
    """The latent attention's shapes and the MoE layers after the first
    ``first_k_dense_replace``, with shared experts and grouped routing."""
    cfg = config.values
    layers = int(cfg["num_hidden_layers"])
    experts, inter = int(cfg["n_routed_experts"]), int(cfg["moe_intermediate_size"])
    moe = MoESpec(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=inter,
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=tuple(range(int(cfg.get("first_k_dense_replace") or 0), layers)) if experts else (),
        shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
        fp32_weights=True,
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )
    return decoder_spec(config, moe=moe, mla=_mla(cfg))


def _mla(cfg: dict) -> MLASpec:
    if cfg.get("attention_bias"):
        raise ValueError("deepseek_v3 with attention_bias is not supported (no released checkpoint has it)")
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default" and params.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        factor = float(params["factor"])
        mscale = yarn_mscale(factor, float(params["mscale_all_dim"]))
        scale *= mscale * mscale
    q_rank = cfg.get("q_lora_rank")
    return MLASpec(
        q_lora_rank=int(q_rank) if q_rank else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale,
    )


FAMILY = Family(
    architectures=(Architecture("DeepseekV3ForCausalLM", "deepseek_v3", DeepseekV3ForCausalLM),),
    read_config=read_config,
)
