"""The architecture facts the engine needs, read from a checkpoint's ``config.json``.

Both spellings are accepted: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). EOS ids come from ``generation_config.json`` when it has them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from conveyor.engine.models.config_defaults import with_transformers_defaults
from conveyor.engine.models.gemma4_spec import Gemma4Spec
from conveyor.engine.models.hybrid_config import LinearAttentionSpec, language_model_config
from conveyor.engine.models.yarn import yarn_inv_freq, yarn_mscale

# Each architecture we have a forward pass for (``conveyor.engine.models.registry``), and its model_type.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Gemma4ForCausalLM": "gemma4_text",
    "GptOssForCausalLM": "gpt_oss",
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo3ForCausalLM": "olmo3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
    "BertModel": "bert",
    "XLMRobertaModel": "xlm-roberta",
    # Cross-encoders (a classification head over the encoder: ``conveyor.engine.models.bert_heads``).
    "BertForSequenceClassification": "bert",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
}
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_ARCHITECTURES.values())
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma4_text")
# Gemma's MLP activations (``hidden_activation``) we implement.
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# The families whose ``attention_bias`` covers o_proj too (the others bias q/k/v only).
_O_BIAS_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "smollm3", "olmo3")
# Encoder-only embedders (``conveyor.engine.models.bert``): bidirectional attention, no KV cache.
ENCODER_MODEL_TYPES = ("bert", "xlm-roberta")
# Their feed-forward activations we implement (transformers' names).
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
_CHECKPOINT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    architecture: str  # the ``SUPPORTED_ARCHITECTURES`` key whose forward pass runs it
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
    # SmolLM3: which layers turn their queries and keys with RoPE (None: every layer; the
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
        cfg = language_model_config(cfg)  # a multimodal Qwen3.5's language model
        model_type = cfg.get("model_type")
        architecture = _architecture(cfg)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        if cfg.get("text_config"):  # a multimodal wrapper around a supported text model
            raise ValueError("multimodal checkpoints are not supported")
        cfg = with_transformers_defaults(cfg)
        if model_type in ENCODER_MODEL_TYPES:
            return _encoder_spec(cfg, architecture)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        gemma = _GemmaFields.from_config(cfg) if model_type in GEMMA_MODEL_TYPES else _GemmaFields()
        if model_type == "olmo3":  # (its sliding layers' RoPE base, as Gemma 3's, in ``local_rope_theta``)
            local_theta, olmo3_rope = _olmo3_rope(cfg)
            gemma = dataclasses.replace(gemma, local_rope_theta=local_theta, global_rope_config=olmo3_rope)
        theta, scaling, partial = _rope(gemma.global_rope_config if gemma.global_rope_config is not None else cfg)
        sliding, sliding_layers = _sliding_layers(cfg, model_type, int(cfg["num_hidden_layers"]))
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
        g4 = Gemma4Spec.from_config(cfg) if model_type == "gemma4_text" else None
        if g4 is not None:  # the cache's per-token slot: the layer kind whose K/V is larger
            shapes = (g4.kv_shape("sliding_attention"), g4.kv_shape("full_attention"))
            kv_heads, head_dim = max(shapes, key=lambda shape: shape[0] * shape[1])
            cfg = {**cfg, "num_key_value_heads": kv_heads}
        moe = MoESpec.from_config(cfg)
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=_dense_intermediate_size(cfg, moe),
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2"
            or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
            or (model_type != "phi3" and bool(cfg.get("attention_bias", False))),
            o_bias=model_type in _O_BIAS_MODEL_TYPES and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text")
            or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm", False))),
            sliding_window=sliding,
            sliding_layers=sliding_layers,
            hidden_act=gemma.hidden_act,
            query_pre_attn_scalar=gemma.query_pre_attn_scalar,
            attn_logit_softcap=gemma.attn_logit_softcap,
            final_logit_softcap=gemma.final_logit_softcap,
            local_rope_theta=gemma.local_rope_theta,
            checkpoint_dtype=_CHECKPOINT_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
            eos_token_ids=eos_ids,
            moe=moe,
            gemma4=g4,
            rope_layers=_rope_layers(cfg) if model_type == "smollm3" else None,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)) if model_type == "gpt_oss" else None,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            mla=MLASpec.from_config(cfg),
            linear_attention=LinearAttentionSpec.from_config(cfg),
        )

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

    @classmethod
    def from_config(cls, cfg: dict) -> MoESpec | None:
        model_type, layers = cfg.get("model_type"), int(cfg["num_hidden_layers"])
        if model_type == "mixtral":
            return cls(
                num_experts=int(cfg["num_local_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate_size=int(cfg["intermediate_size"]),
                renormalize=True,
                sparse_layers=tuple(range(layers)),
                fp32_weights=True,
            )
        if model_type == "glm4_moe":
            return cls._glm4_moe(cfg, layers)
        if model_type == "gpt_oss":  # (routing and experts: ``conveyor.engine.models.gpt_oss``)
            return cls(
                num_experts=int(cfg["num_local_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate_size=int(cfg["intermediate_size"]),
                renormalize=True,
                sparse_layers=tuple(range(layers)),
            )
        if model_type == "deepseek_v3":
            experts, inter = int(cfg["n_routed_experts"]), int(cfg["moe_intermediate_size"])
            return cls(
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
        if model_type == "qwen3_5_moe_text":  # every layer sparse, renormalised, a gated shared expert
            return cls(
                num_experts=int(cfg["num_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate_size=int(cfg["moe_intermediate_size"]),
                renormalize=True,
                sparse_layers=tuple(range(layers)),
                shared_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
            )
        if model_type not in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
            return None
        # (transformers 5.x writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``)
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        return cls(
            num_experts=num_experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            renormalize=bool(cfg.get("norm_topk_prob", model_type == "qwen3_next")),  # (its default: true)
            sparse_layers=sparse,
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if model_type in ("qwen2_moe", "qwen3_next")
            else 0,
        )

    @classmethod
    def _glm4_moe(cls, cfg: dict, layers: int) -> MoESpec:
        num_experts, groups = int(cfg["n_routed_experts"]), int(cfg.get("n_group") or 1)
        if num_experts % groups or num_experts // groups < 2:
            raise ValueError(f"n_routed_experts {num_experts} must split into n_group {groups} groups of 2 or more")
        return cls(
            num_experts=num_experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            sparse_layers=tuple(range(int(cfg.get("first_k_dense_replace", 1)), layers)),
            shared_intermediate_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0),
            fp32_weights=True,
            n_group=groups,
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        )


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

    @classmethod
    def from_config(cls, cfg: dict) -> MLASpec | None:
        if cfg.get("model_type") != "deepseek_v3":
            return None
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
        return cls(
            q_lora_rank=int(q_rank) if q_rank else None,
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(cfg["v_head_dim"]),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            softmax_scale=scale,
        )


@dataclass(frozen=True)
class _GemmaFields:
    """What a Gemma 2/3 config adds to Llama's (``ModelSpec`` documents each field).
    ``global_rope_config``: Gemma 3's full layers' RoPE as a config ``_rope`` reads."""

    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None
    global_rope_config: dict | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> _GemmaFields:
        model_type = cfg["model_type"]
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{model_type} with use_bidirectional_attention is not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GEMMA_ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported; supported: {GEMMA_ACTIVATIONS}")
        local_theta, global_rope = None, None
        if model_type == "gemma3_text":
            local_theta, global_rope = _gemma3_rope(cfg)
        final_cap = cfg.get("final_logit_softcapping")
        attn_cap = cfg.get("attn_logit_softcapping")
        return cls(
            hidden_act=act,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            # (transformers' Gemma 3 attention never passes its attn_logit_softcapping on)
            attn_logit_softcap=float(attn_cap) if attn_cap and model_type == "gemma2" else None,
            final_logit_softcap=float(final_cap) if final_cap else None,
            local_rope_theta=local_theta,
            global_rope_config=global_rope,
        )


def _gemma3_rope(cfg: dict) -> tuple[float, dict]:
    """Gemma 3's RoPE: the sliding layers' base (default RoPE) and a config holding the full
    layers' RoPE in the spelling ``_rope`` reads. transformers 5.x writes one
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


def _olmo3_rope(cfg: dict) -> tuple[float, dict]:
    """OLMo 3's RoPE: the sliding layers' base (default RoPE) and a config holding the full
    layers' RoPE in the spelling ``_rope`` reads. transformers 5.x writes one
    ``rope_parameters`` entry per layer type; 4.x wrote ``rope_theta`` for both and
    ``rope_scaling`` for the full layers only."""
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


def _sliding_layers(cfg: dict, model_type: str, num_layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """The sliding window and which layers use it (None: every layer), as transformers
    applies them for each family: Mistral, Phi-3 and Mixtral slide every layer when the config
    has a window; Qwen only with ``use_sliding_window`` (Qwen2/3 and Qwen2-MoE per
    ``layer_types``, else their ``max_window_layers`` rules; Qwen3-MoE every layer); Gemma per
    ``layer_types``, else the older ``sliding_window_pattern`` (every n-th layer is full)."""
    window = cfg.get("sliding_window")
    if not window or model_type == "llama":
        return None, None
    if model_type in ("mistral", "phi3", "mixtral"):
        return int(window), None
    types = cfg.get("layer_types")
    if model_type == "gpt_oss":  # (transformers' default: even layers slide)
        default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    elif model_type == "olmo3":  # (transformers' default: every 4th layer is full)
        default = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    elif model_type in GEMMA_MODEL_TYPES:
        pattern = int(cfg.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6))
        default = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    elif not cfg.get("use_sliding_window"):
        return None, None
    elif model_type == "smollm3":  # (transformers' default: the NoPE layers slide)
        default = ["full_attention" if rope else "sliding_attention" for rope in _rope_layers(cfg)]
    elif model_type == "qwen3_moe":
        return int(window), None
    elif model_type == "qwen2_moe":
        limit = int(cfg.get("max_window_layers", 28))
        default = ["sliding_attention" if (i + 1) % 2 and i < limit else "full_attention" for i in range(num_layers)]
    else:  # qwen2, qwen3
        limit = int(cfg.get("max_window_layers", 28))
        default = ["sliding_attention" if i >= limit else "full_attention" for i in range(num_layers)]
    types = types or default
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported (sliding_attention, full_attention)")
    sliding = tuple(t == "sliding_attention" for t in types)
    return (int(window), sliding) if any(sliding) else (None, None)


def _rope_layers(cfg: dict) -> tuple[bool, ...]:
    """SmolLM3's ``no_rope_layers`` (1: the layer uses RoPE), or transformers' default from
    ``no_rope_layer_interval`` (every n-th layer is NoPE)."""
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(bool(f) for f in flags)


def _architecture(cfg: dict) -> str:
    """The supported architecture a config names (its ``architectures``, else its model_type's)."""
    names = cfg.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if names:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"architecture {', '.join(map(str, names))} is not supported; supported: {supported}")
    by_type: dict[str, str] = {}
    for arch, model_type in SUPPORTED_ARCHITECTURES.items():  # the first listed: the base model, not a head
        by_type.setdefault(model_type, arch)
    return by_type.get(str(cfg.get("model_type")), "")  # "" only for an unsupported model_type, refused next


def _rope(cfg: dict) -> tuple[float, dict, float]:
    """RoPE's base, its scaling parameters (``rope_type`` always set; for longrope, with
    ``original_max_position_embeddings``, ``factor`` and ``attention_factor`` resolved as
    transformers resolves them) and the partial rotary factor."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:  # transformers 5.x
        scaling = dict(params)
        theta = scaling.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:  # transformers 4.x
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    partial = float(scaling.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    kind = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    if kind in ("su", "yarn") and cfg.get("model_type") == "phi3":  # Phi-3's old names for longrope
        kind = "longrope"
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


def _encoder_spec(cfg: dict, architecture: str) -> ModelSpec:
    """A BERT or XLM-RoBERTa encoder's spec; ``ValueError`` for what the native encoder does
    not compute (relative position embeddings, a decoder configuration, another activation)."""
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"position_embedding_type {kind!r} is not supported; the encoder has absolute positions")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise ValueError("a BERT/XLM-RoBERTa configured as a decoder is not supported; the engine embeds with encoders")
    act = cfg.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; supported: {ENCODER_ACTIVATIONS}")
    num_heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    pad = cfg.get("pad_token_id")
    # XLM-R numbers positions from ``pad_token_id + 1`` (its first rows are never used).
    offset = int(pad) + 1 if cfg["model_type"] == "xlm-roberta" and pad is not None else 0
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
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
        checkpoint_dtype=_CHECKPOINT_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None,
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
