"""Encoder-only embedders: BERT and XLM-RoBERTa (bge-m3, e5, MiniLM...), as transformers'
``BertModel`` and ``XLMRobertaModel`` compute them over a flat, unpadded batch of whole inputs.

Word, absolute position and token type embeddings then a LayerNorm (a token's type rides in
its id: ``type * vocab_size + word``, ``encode_token_types``; a single text is all type 0, a
cross-encoder's pair has its second text's tokens at type 1, as the tokenizer says); each
layer is bidirectional attention and a GELU feed-forward block, each followed
by a residual add and a LayerNorm (post-LN). The output is the last layer's hidden states,
which ``conveyor.engine.pooling`` pools (CLS or mean, as the checkpoint's sentence-transformers files
say); the checkpoint's pooler head, which sentence-transformers ignores, is not loaded. A
``*ForSequenceClassification`` checkpoint (a cross-encoder) also loads its classification
head (``conveyor.engine.models.bert_heads``), which scoring runs on the first token.

Every token attends to every token of its own input, so an input runs whole in one step and
nothing is cached: ``encoder_engine_config`` turns chunked prefill and the prefix cache off
and gives the block pool only block ids (``ModelSpec.kv_cache_layers`` is 0, so the runner
allocates no K/V tensors); an embedding request frees its block ids in the step it runs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.config import EngineConfig
from conveyor.engine.distributed.sharding import WeightSlot
from conveyor.engine.models.bert_heads import ClassifierHead
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.model_config import ModelSpec, checkpoint_dtype
from conveyor.kernels.utils import cdiv

log = logging.getLogger(__name__)

# transformers' activation names -> the function: the feed-forward activations we implement.
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# Checkpoint tensors an embedder does not use: the pooler head, the stored position ids.
_UNUSED_TENSORS = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")
# Where a ``*ForSequenceClassification`` checkpoint keeps the encoder's own tensors.
_CLASSIFIER_PREFIXES = ("bert.", "roberta.")


def encode_token_types(ids: list[int], types: list[int], vocab_size: int) -> list[int]:
    """Token ids carrying their token types (``BertEncoder.forward`` splits them again)."""
    return [word + vocab_size * kind for word, kind in zip(ids, types, strict=True)]


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class _Linear(nn.Module):
    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(rows, cols, dtype=dtype, device=device)
        self.bias = _param(rows, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.bias = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class EncoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = spec.hidden_size, spec.intermediate_size
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.scale = spec.head_dim**-0.5
        # query, key and value fused into one matmul at load time.
        self.qkv = _Linear(3 * hidden, hidden, dtype, device)
        self.attn_out = _Linear(hidden, hidden, dtype, device)
        self.attn_norm = _LayerNorm(hidden, spec.layer_norm_eps, dtype, device)
        self.up = _Linear(inter, hidden, dtype, device)
        self.down = _Linear(hidden, inter, dtype, device)
        self.out_norm = _LayerNorm(hidden, spec.layer_norm_eps, dtype, device)
        self.act = _ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(dim=1)
        out = torch.empty_like(q)
        start = 0
        for n in lengths:  # each input attends over its own tokens only, in both directions
            part = slice(start, start + n)
            qb, kb, vb = (t[part].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out[part] = F.scaled_dot_product_attention(qb, kb, vb, scale=self.scale)[0].transpose(0, 1)
            start += n
        x = self.attn_norm(x + self.attn_out(out.view(x.shape)))
        return self.out_norm(x + self.down(self.act(self.up(x))))

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        hidden = self.attn_out.weight.shape[0]
        slots: dict[str, WeightSlot] = {}
        for i, name in enumerate(("query", "key", "value")):
            slots[f"{prefix}attention.self.{name}.weight"] = (self.qkv.weight, i * hidden, hidden)
            slots[f"{prefix}attention.self.{name}.bias"] = (self.qkv.bias, i * hidden, hidden)
        for name, module in (
            ("attention.output.dense", self.attn_out),
            ("attention.output.LayerNorm", self.attn_norm),
            ("intermediate.dense", self.up),
            ("output.dense", self.down),
            ("output.LayerNorm", self.out_norm),
        ):
            for part in ("weight", "bias"):
                tensor = getattr(module, part)
                slots[f"{prefix}{name}.{part}"] = (tensor, 0, tensor.shape[0])
        return slots


class BertEncoder(nn.Module):
    """``BertModel`` / ``XLMRobertaModel``'s last hidden states for whole inputs packed back to back."""

    # Every step is a prefill of whole inputs: there is no decode to capture.
    supports_cuda_graphs = False

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        hidden = spec.hidden_size
        # (the position table as the checkpoint has it: XLM-R's first rows included)
        positions = spec.max_position_embeddings - 1 + spec.position_offset
        self.word_embeddings = _param(spec.vocab_size, hidden, dtype=dtype, device=device)
        self.position_embeddings = _param(positions, hidden, dtype=dtype, device=device)
        self.token_type_embeddings = _param(spec.type_vocab_size, hidden, dtype=dtype, device=device)
        self.embed_norm = _LayerNorm(hidden, spec.layer_norm_eps, dtype, device)
        self.layers = nn.ModuleList(EncoderLayer(spec, dtype, device) for _ in range(spec.num_layers))
        self.score_head = ClassifierHead(spec, dtype, device) if spec.num_labels else None

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend: AttentionBackend, kv_caches) -> torch.Tensor:
        lengths = whole_input_lengths(backend)
        types = torch.div(input_ids, self.spec.vocab_size, rounding_mode="floor")
        input_ids = input_ids - types * self.spec.vocab_size
        x = F.embedding(input_ids, self.word_embeddings)
        x = x + F.embedding(self._position_ids(input_ids, positions), self.position_embeddings)
        x = self.embed_norm(x + F.embedding(types, self.token_type_embeddings))
        for layer in self.layers:
            x = layer(x, lengths)
        return x

    def _position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """BERT: the token's index. XLM-R (transformers' ``create_position_ids_from_input_ids``):
        ``pad + 1`` plus the count of non-padding tokens before it in its input, and ``pad``
        for a padding token."""
        pad = self.spec.pad_token_id
        if not self.spec.position_offset or pad is None:
            return positions
        real = (input_ids != pad).long()
        seen = torch.cumsum(real, dim=0)
        first = torch.arange(len(input_ids), device=input_ids.device) - positions  # each input's first row
        before = seen[first] - real[first]
        return (seen - before) * real + pad

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder has no vocabulary head: one zero logit per row, which finishes each
        embedding request with a token nobody reads (its vector is the hidden states')."""
        return hidden.new_zeros(hidden.shape[0], 1)

    def checkpoint_name(self, name: str) -> str | None:
        """The checkpoint tensor's name, or None for those an embedder does not use (the
        pooler head, unless a cross-encoder's head runs it; the stored position ids)."""
        if self.score_head is not None:
            if name in self.score_head.weight_slots():
                return name
            name = name.removeprefix(next((p for p in _CLASSIFIER_PREFIXES if name.startswith(p)), ""))
        return None if name in _UNUSED_TENSORS else name

    def weight_slots(self) -> dict[str, WeightSlot]:
        """Each HF tensor name (``BertModel``/``XLMRobertaModel``'s, no prefix) -> (our tensor, row offset, rows)."""
        slots: dict[str, WeightSlot] = {}
        for name, tensor in (
            ("embeddings.word_embeddings.weight", self.word_embeddings),
            ("embeddings.position_embeddings.weight", self.position_embeddings),
            ("embeddings.token_type_embeddings.weight", self.token_type_embeddings),
            ("embeddings.LayerNorm.weight", self.embed_norm.weight),
            ("embeddings.LayerNorm.bias", self.embed_norm.bias),
        ):
            slots[name] = (tensor, 0, tensor.shape[0])
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, EncoderLayer)  # (for the type checker)
            slots.update(layer.weight_slots(f"encoder.layer.{i}."))
        if self.score_head is not None:
            slots.update(self.score_head.weight_slots())
        return slots


def whole_input_lengths(backend: AttentionBackend) -> list[int]:
    """Each input's length in this step; ``RuntimeError`` when one is not whole (a chunk, or a
    prefix from the cache), which ``encoder_engine_config`` rules out."""
    meta = backend.meta
    if meta.query_lens_host != meta.seq_lens_host:
        raise RuntimeError("an encoder input must run whole in one step (no chunked prefill, no prefix cache)")
    return meta.query_lens_host


def encoder_engine_config(config: EngineConfig, spec: ModelSpec) -> EngineConfig:
    """The configuration an engine serving ``spec`` runs: unchanged for a decoder; for an
    encoder, chunked prefill and the prefix cache off (an input runs whole: one longer than
    ``max_num_batched_tokens`` is refused when added) and a block pool of ids only, enough for
    ``max_num_seqs`` inputs of full length. ``ValueError`` for what an encoder cannot use."""
    if not spec.encoder:
        return config
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(f"{spec.architecture} runs on one device: tensor_parallel_size must be 1")
    if config.speculative is not None:
        raise ValueError(f"{spec.architecture} only embeds: speculative decoding does not apply")
    max_len = config.max_model_len_for(spec, "native")
    blocks = config.cache.num_kv_blocks or config.scheduler.max_num_seqs * cdiv(max_len, config.cache.block_size)
    log.info(
        "%s is an encoder: each input runs whole in one step (at most max_num_batched_tokens=%d tokens), "
        "no chunked prefill, no prefix cache, no KV tensors",
        spec.architecture,
        config.scheduler.max_num_batched_tokens,
    )
    return config.replace(
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        num_kv_blocks=blocks,
        max_model_len=min(max_len, config.scheduler.max_num_batched_tokens),
        # (there are no decodes whose inter-token latency a prefill limit would protect)
        target_itl_ms=None,
    )


def read_config(config: CheckpointConfig) -> ModelSpec:
    """A BERT or XLM-RoBERTa encoder's spec; ``ValueError`` for what the native encoder does
    not compute (relative position embeddings, a decoder configuration, another activation)."""
    cfg, architecture = config.values, config.architecture
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"position_embedding_type {kind!r} is not supported; the encoder has absolute positions")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError("a BERT/XLM-RoBERTa configured as a decoder is not supported; the engine embeds with encoders")
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; supported: {tuple(_ACTIVATIONS)}")
    num_heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    pad = cfg.get("pad_token_id")
    # XLM-R numbers positions from ``pad_token_id + 1`` (its first rows are never used).
    offset = int(pad) + 1 if cfg["model_type"] == "xlm-roberta" and pad is not None else 0
    return ModelSpec(
        model_type=cfg["model_type"],
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        rms_norm_eps=0.0,
        # One more than the positions: the token an embedding request samples to finish is
        # never run through the model, so a prompt may use every position.
        max_position_embeddings=int(cfg.get("max_position_embeddings", 512)) - offset + 1,
        rope_theta=0.0,
        hidden_act=act,
        checkpoint_dtype=checkpoint_dtype(cfg),
        encoder=True,
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        position_offset=offset,
        pad_token_id=None if pad is None else int(pad),
        num_labels=_num_labels(cfg) if architecture.endswith("ForSequenceClassification") else 0,
    )


def _num_labels(cfg: dict) -> int:
    """A classifier's outputs as transformers counts them: ``id2label``'s size, else ``num_labels``, else 2."""
    labels = cfg.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else int(cfg.get("num_labels", 2))


# The base models first: a config without ``architectures`` is read as an embedder.
FAMILY = Family(
    architectures=(
        Architecture("BertModel", "bert", BertEncoder),
        Architecture("XLMRobertaModel", "xlm-roberta", BertEncoder),
        # Cross-encoders: a classification head over the encoder (``bert_heads``).
        Architecture("BertForSequenceClassification", "bert", BertEncoder),
        Architecture("XLMRobertaForSequenceClassification", "xlm-roberta", BertEncoder),
    ),
    read_config=read_config,
)
