"""The architecture facts the engine needs, read from a checkpoint's ``config.json``: what
every family reads alike. Each family reads its own fields in its module (its ``FAMILY``'s
``read_config``, found by ``conveyor.engine.models.family``), mostly by calling
``decoder_spec`` with them.

Both spellings are accepted: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). EOS ids come from ``generation_config.json`` when it has them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from conveyor.engine.models import family
from conveyor.engine.models.config_defaults import with_transformers_defaults
from conveyor.engine.models.family import CheckpointConfig
from conveyor.engine.models.gemma4_spec import Gemma4Spec
from conveyor.engine.models.hybrid_config import LinearAttentionSpec
from conveyor.engine.models.yarn import yarn_inv_freq, yarn_mscale

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
_CHECKPOINT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    architecture: str  # the ``architectures`` entry whose forward pass runs it (``registry``)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # RoPE turns the first ``head_dim * this`` dims only
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # The attention window of sliding layers: every layer's, unless ``sliding_layers`` says
    # which layers slide (``layer_window``).
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    # Gemma 2/3: the MLP activation, the query scale's denominator (``query_pre_attn_scalar**-0.5``
    # replaces ``head_dim**-0.5``), soft caps on the attention scores and the final logits, and
    # Gemma 3's RoPE base for sliding layers (its full layers use ``rope_theta``/``rope_scaling``).
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None
    checkpoint_dtype: torch.dtype | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoESpec | None = None  # the mixture-of-experts layers, for the MoE families
    # Which layers turn their queries and keys with RoPE (None: every layer; the
    # others are NoPE layers).
    rope_layers: tuple[bool, ...] | None = None
    # gpt-oss's experts' clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``).
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    mla: MLASpec | None = None  # multi-head latent attention (DeepSeek-V3), whose cache holds latents
    gemma4: Gemma4Spec | None = None  # Gemma 4's per-kind KV shapes, shared KV, per-layer inputs

    # Hybrid models (Qwen3.5): which layers are linear attention, and their shapes.
    linear_attention: LinearAttentionSpec | None = None

    # Encoders (BERT, XLM-RoBERTa): post-LN LayerNorms' eps, the token type table's rows, the
    # first position's row in the position table (XLM-R's ``pad_token_id + 1``) and the
    # padding id XLM-R's positions skip.
    encoder: bool = False
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    position_offset: int = 0
    pad_token_id: int | None = None
    # A cross-encoder's classifier outputs (``*ForSequenceClassification``); 0: no classifier.
    num_labels: int = 0

    @property
    def kv_cache_layers(self) -> int:
        """The layers that own K/V in the cache: Gemma 4's shared-KV layers, a hybrid model's
        linear-attention layers and an encoder's layers own none."""
        if self.encoder:
            return 0
        shared = self.gemma4.num_kv_shared_layers if self.gemma4 is not None else 0
        linear = sum(self.linear_attention.linear_layers) if self.linear_attention is not None else 0
        return self.num_layers - shared - linear

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json")
        cfg = _read_json(path / "config.json")
        gen_path = path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.exists() else {}
        return cls.from_dicts(cfg, gen)

    @classmethod
    def from_dicts(cls, cfg: dict, gen: dict | None = None) -> ModelSpec:
        gen = gen or {}
        cfg = family.language_model_config(cfg)  # a multimodal checkpoint's language model
        model_type = cfg.get("model_type")
        architecture = _architecture(cfg, family.supported_architectures())
        read = family.config_reader(str(model_type))
        if read is None:
            supported = tuple(family.supported_architectures().values())
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported}")
        if cfg.get("text_config"):  # a multimodal wrapper around a supported text model
            raise ValueError("multimodal checkpoints are not supported")
        cfg = with_transformers_defaults(cfg)
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        spec = read(CheckpointConfig(cfg, architecture, eos_ids))
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"the {model_type} family's read_config returned a {type(spec).__name__}, not a ModelSpec")
        return spec

    def layer_window(self, index: int) -> int | None:
        """The attention window of layer ``index`` (None: it attends to the whole context)."""
        if self.sliding_layers is not None and not self.sliding_layers[index]:
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_inv_freq(self, max_len: int) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (``rotary_dim / 2``) and the attention scaling factor (cos and
        sin are multiplied by it) for the configured RoPE, for sequences up to ``max_len``."""
        dim = self.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        s = self.rope_scaling
        kind = s.get("rope_type", "default")
        if kind == "longrope":
            return _longrope_inv_freq(exponents, self.rope_theta, s, max_len)
        if kind == "yarn":
            return yarn_inv_freq(dim, self.rope_theta, s, self.max_position_embeddings)
        inv_freq = 1.0 / (self.rope_theta**exponents)
        if kind == "linear":
            inv_freq = inv_freq / s["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, s)
        return inv_freq, 1.0


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts model's routing: each token's router softmax, its ``top_k``
    experts, their weights renormalised to sum to one when ``renormalize``; Qwen2-MoE's shared
    expert (``shared_intermediate_size`` > 0) added, gated by a sigmoid. ``sparse_layers``:
    which layers are MoE (the rest are dense MLPs of ``ModelSpec.intermediate_size``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool
    sparse_layers: tuple[int, ...]
    shared_intermediate_size: int = 0
    fp32_weights: bool = False  # Mixtral keeps the routing weights in float32; Qwen casts them
    # DeepSeek-V3's and GLM-4.5's grouped routing (``moe.grouped_sigmoid_route``): sigmoid scores
    # plus a correction bias choose the experts from the best ``topk_group`` of ``n_group``
    # groups; the chosen weights are scaled by ``routed_scaling_factor``.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    ``q_lora_rank`` bottleneck; keys and values from one ``kv_lora_rank`` latent per token (what
    the cache holds, with the ``qk_rope_head_dim`` rope key all heads share). Each head's key is
    its ``qk_nope_head_dim`` part from the latent then the rope part; its value ``v_head_dim``.
    ``softmax_scale``: ``qk_head_dim**-0.5``, times YaRN's ``mscale**2`` where configured."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def latent_width(self) -> int:
        """One cached token of one layer: the latent then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def decoder_spec(
    config: CheckpointConfig,
    *,
    rope_config: dict | None = None,
    rope_aliases: Mapping[str, str] | None = None,
    **fields: Any,
) -> ModelSpec:
    """A decoder's spec: what every decoder family reads alike from ``config``, with the
    family's own ``fields`` (any ``ModelSpec`` field) over it. RoPE is read from
    ``rope_config`` where the family gives one (the full layers' RoPE of a model whose
    sliding layers have their own). Without sliding fields, layers slide as transformers'
    Qwen2 places them (``default_sliding``)."""
    cfg = config.values
    num_heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    theta, scaling, partial = read_rope(rope_config if rope_config is not None else cfg, rope_aliases)
    if "sliding_window" not in fields:
        fields = {**default_sliding(cfg), **fields}
    common: dict[str, Any] = {
        "model_type": cfg["model_type"],
        "architecture": config.architecture,
        "vocab_size": cfg["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": _dense_intermediate_size(cfg, fields.get("moe")),
        "num_layers": cfg["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or num_heads,
        "head_dim": cfg.get("head_dim") or hidden // num_heads,
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "partial_rotary_factor": partial,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qkv_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "checkpoint_dtype": checkpoint_dtype(cfg),
        "eos_token_ids": config.eos_token_ids,
    }
    return ModelSpec(**{**common, **fields})


def checkpoint_dtype(cfg: dict) -> torch.dtype | None:
    """The dtype the checkpoint's weights are stored in (``dtype``; 4.x: ``torch_dtype``)."""
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return _CHECKPOINT_DTYPES.get(name) if isinstance(name, str) else None


_NO_SLIDING: dict[str, Any] = {"sliding_window": None, "sliding_layers": None}


def sliding_every_layer(cfg: dict) -> dict[str, Any]:
    """Every layer slides when the config has a window (Mistral's rule)."""
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window), "sliding_layers": None} if window else _NO_SLIDING


def sliding_per_layer(cfg: dict, default_types: Callable[[], Sequence[str]]) -> dict[str, Any]:
    """With a window, the layers ``layer_types`` marks ``sliding_attention`` slide (without
    ``layer_types``: those of the family's ``default_types``); no window, or no sliding
    layer: none slides."""
    window, num_layers = cfg.get("sliding_window"), int(cfg["num_hidden_layers"])
    if not window:
        return _NO_SLIDING
    types = cfg.get("layer_types") or default_types()
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported (sliding_attention, full_attention)")
    sliding = tuple(t == "sliding_attention" for t in types)
    return {"sliding_window": int(window), "sliding_layers": sliding} if any(sliding) else _NO_SLIDING


def default_sliding(cfg: dict) -> dict[str, Any]:
    """Only with ``use_sliding_window``: the layers from ``max_window_layers`` on slide
    (transformers' Qwen2 rule, for the families that give no rule of their own)."""
    if not cfg.get("use_sliding_window"):
        return _NO_SLIDING
    limit, layers = int(cfg.get("max_window_layers", 28)), int(cfg["num_hidden_layers"])
    return sliding_per_layer(
        cfg, lambda: ["sliding_attention" if i >= limit else "full_attention" for i in range(layers)]
    )


def _architecture(cfg: dict, supported: dict[str, str]) -> str:
    """The supported architecture a config names (its ``architectures``, else its model_type's)."""
    names = cfg.get("architectures") or []
    for name in names:
        if name in supported:
            return name
    if names:
        listed = ", ".join(supported)
        raise ValueError(f"architecture {', '.join(map(str, names))} is not supported; supported: {listed}")
    by_type: dict[str, str] = {}
    for arch, model_type in supported.items():  # the first listed: the base model, not a head
        by_type.setdefault(model_type, arch)
    return by_type.get(str(cfg.get("model_type")), "")  # "" only for an unsupported model_type, refused next


def read_rope(cfg: dict, aliases: Mapping[str, str] | None = None) -> tuple[float, dict, float]:
    """RoPE's base, its scaling parameters (``rope_type`` always set; for longrope, with
    ``original_max_position_embeddings``, ``factor`` and ``attention_factor`` resolved as
    transformers resolves them) and the partial rotary factor. ``aliases``: a family's old names
    for rope types."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:  # transformers 5.x
        scaling = dict(params)
        theta = scaling.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:  # transformers 4.x
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    partial = float(scaling.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    kind = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    kind = (aliases or {}).get(kind, kind)
    scaling["rope_type"] = kind
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if kind == "yarn":
        _resolve_yarn(scaling, cfg)
    if kind == "longrope":
        original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if not original:
            raise ValueError("longrope scaling needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original = int(original)
        # Phi-3 gives no factor: the ratio of the context lengths is the factor.
        factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
        scaling["factor"] = factor
        if scaling.get("attention_factor") is None:
            scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return float(theta), scaling, partial


def _longrope_inv_freq(exponents: torch.Tensor, theta: float, s: dict, max_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE: the base frequencies divided by per-dimension factors, the long ones when
    sequences may grow past the original context, else the short ones.

    transformers picks the set per forward call (long once that call's last position passes
    the original context), which would leave keys of both kinds in one sequence's cache and
    makes a prefix-cached block's keys depend on who computed them. One set per engine, chosen
    by its ``max_len`` (as vLLM does), keeps every cached key valid; it matches transformers
    token for token whenever every sequence stays on one side of the original context."""
    long = max_len > s["original_max_position_embeddings"]
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta**exponents), float(s["attention_factor"])


def _resolve_yarn(scaling: dict, cfg: dict) -> None:
    """YaRN's factor and attention factor, resolved in place as transformers resolves them."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise ValueError("yarn scaling needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = original = int(original)
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    scaling["factor"] = factor = float(factor)
    if scaling.get("attention_factor") is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling["attention_factor"] = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            scaling["attention_factor"] = yarn_mscale(factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _dense_intermediate_size(cfg: dict, moe: MoESpec | None) -> int:
    """The dense MLPs' width; 0 where every layer is a mixture of experts (Qwen3.5-MoE's
    config has no ``intermediate_size``: it has no dense MLP)."""
    size = cfg.get("intermediate_size")
    if size:
        return int(size)
    if moe is not None and len(moe.sparse_layers) == int(cfg["num_hidden_layers"]):
        return 0
    raise ValueError(f"{cfg.get('model_type')} config has no intermediate_size for its dense MLP layers")


def _read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; ``ValueError`` naming the file when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data
