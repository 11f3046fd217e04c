"""The Llama family (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm): the decoder
the other families extend, stacking ``conveyor.engine.models.layers``' layers over a flat,
unpadded batch of tokens, and the reading of these four families' configs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.sharding import Shard, WeightSlot, vocab_shard
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding, _param
from conveyor.engine.models.model_config import (
    ModelSpec,
    decoder_spec,
    sliding_every_layer,
)


class LlamaForCausalLM(nn.Module):
    # Its decode step has fixed shapes and no host syncs, so it can be captured as a CUDA graph.
    supports_cuda_graphs = True
    # Where each layer's feed-forward tensors live in the checkpoint.
    mlp_prefix = "mlp."

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        # Under tensor parallelism, this rank's vocabulary rows (padded: equal on every rank).
        self.tp = parallel_state.current()
        self.vocab = vocab = vocab_shard(spec.vocab_size, self.tp)
        self.embed_tokens = _param(vocab.padded, spec.hidden_size, dtype=dtype, device=device)
        if vocab.rows < vocab.padded:
            self.embed_tokens.data[vocab.rows :].zero_()
        self.layers = nn.ModuleList(self.make_layer(i, dtype, device) for i in range(spec.num_layers))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)  # (for the type checker)
            layer.self_attn.sliding_window = spec.layer_window(i)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if spec.tie_word_embeddings
            else _param(vocab.padded, spec.hidden_size, dtype=dtype, device=device)
        )
        if vocab.rows < vocab.padded:
            self.lm_head.data[vocab.rows :].zero_()
        self.rope = RotaryEmbedding(spec, max_len, dtype, device)

    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        """Layer ``index`` (a family whose layers differ overrides this)."""
        return DecoderLayer(self.spec, dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend: AttentionBackend, kv_caches) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rope, backend, kv_cache)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed_tokens)
        # Each rank looks up the ids in its vocabulary rows (zeros for the others); the sum
        # over the ranks is the embedding.
        local = input_ids - self.vocab.start
        inside = (local >= 0) & (local < self.vocab.rows)
        x = F.embedding(local.clamp(0, self.vocab.padded - 1), self.embed_tokens) * inside.unsqueeze(-1)
        return self.tp.all_reduce(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary. Under tensor parallelism every rank must call it (the
        ranks' vocabulary slices are gathered to rank 0); the other ranks get an empty tensor."""
        logits = F.linear(hidden, self.lm_head)
        if not self.tp.enabled:
            return logits
        full = self.tp.gather_last_dim(logits)
        return full[..., : self.spec.vocab_size] if full is not None else logits.new_empty(0)

    # ---- loading from Hugging Face names ---------------------------------------------
    def skips_weight(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is one this forward pass does not use."""
        return False

    def checkpoint_name(self, name: str) -> str | None:
        """Our name for the checkpoint tensor ``name`` (a multimodal wrapper's language model
        names its tensors otherwise), or None for a tensor this forward pass does not use."""
        return None if self.skips_weight(name) else name

    def beyond_last_layer(self, name: str) -> bool:
        """A tensor of a layer numbered after the decoder's own: the multi-token-prediction layers
        DeepSeek-V3 and GLM-4.5 checkpoints carry (unused)."""
        parts = name.split(".")
        return parts[:2] == ["model", "layers"] and int(parts[2]) >= self.spec.num_layers

    def weight_slots(self) -> dict[str, WeightSlot]:
        """Each HF tensor name -> (our tensor, row offset, rows[, the ``Shard`` of it this
        tensor-parallel rank takes]), for fused loading."""
        spec, vocab = self.spec, self.vocab
        slots: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, vocab.rows, Shard.rows(vocab.start, vocab.rows)),
            "model.norm.weight": (self.norm.weight, 0, spec.hidden_size),
        }
        if not spec.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, 0, vocab.rows, Shard.rows(vocab.start, vocab.rows))

        def linear(
            name: str, weight: torch.Tensor, bias: torch.Tensor | None, offset: int, rows: int, shard: Shard
        ) -> None:
            slots[name + ".weight"] = (weight, offset, rows, shard)
            if bias is not None:  # a row-parallel layer's bias is whole, added once after the sum
                slots[name + ".bias"] = (bias, offset, rows, shard) if shard.dim == 0 else (bias, offset, rows)

        d = spec.head_dim
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)  # a ModuleList types its items as Module
            p = f"model.layers.{i}."
            a, m = layer.self_attn, layer.mlp
            slots[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0, spec.hidden_size)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, spec.hidden_size)
            q, kv, heads = a.q_size, a.kv_size, a.heads
            for name, off, rows, start in (
                ("q_proj", 0, q, heads.head_start * d),
                ("k_proj", q, kv, heads.kv_head_start * d),
                ("v_proj", q + kv, kv, heads.kv_head_start * d),
            ):
                linear(p + f"self_attn.{name}", a.qkv_weight, a.qkv_bias, off, rows, Shard.rows(start, rows))
            linear(
                p + "self_attn.o_proj", a.o_weight, a.o_bias, 0, spec.hidden_size, Shard.cols(heads.head_start * d, q)
            )
            if a.q_norm is not None and a.k_norm is not None:
                slots[p + "self_attn.q_norm.weight"] = (a.q_norm.weight, 0, spec.head_dim)
                slots[p + "self_attn.k_norm.weight"] = (a.k_norm.weight, 0, spec.head_dim)
            slots.update(m.weight_slots(p + self.mlp_prefix))
        return slots


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Llama never slides; Mistral slides every layer when it has a window; Qwen2 and Qwen3
    only with ``use_sliding_window`` (the common rule). Qwen2 always biases q/k/v, Llama and
    Qwen3 bias o_proj too with ``attention_bias``; Qwen3 norms each head's q and k."""
    cfg = config.values
    model_type, bias = cfg["model_type"], bool(cfg.get("attention_bias", False))
    windows = {"llama": sliding_every_layer({}), "mistral": sliding_every_layer(cfg)}.get(model_type, {})
    return decoder_spec(
        config,
        qkv_bias=model_type == "qwen2" or bias,
        o_bias=model_type in ("llama", "qwen3") and bias,
        qk_norm=model_type == "qwen3",
        **windows,
    )


FAMILY = Family(
    architectures=(
        Architecture("LlamaForCausalLM", "llama", LlamaForCausalLM),
        Architecture("MistralForCausalLM", "mistral", LlamaForCausalLM),
        Architecture("Qwen2ForCausalLM", "qwen2", LlamaForCausalLM),
        Architecture("Qwen3ForCausalLM", "qwen3", LlamaForCausalLM),
    ),
    read_config=read_config,
    listed_first=True,
)
