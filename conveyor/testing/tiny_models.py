"""Small random-weight models of each supported family, built locally (no download).

A byte-level BPE tokenizer is trained on a generated corpus with the ``tokenizers`` library
and saved with a ChatML chat template. Weights are drawn with a larger spread than
transformers' default init: the default makes tiny models repeat one token forever, which
would hide attention and KV-cache bugs. Norm weights and biases are random too, so a weight
loaded into the wrong place changes the output.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
FAMILIES += ("gemma2", "gemma3", "glm4_moe", "gemma4", "gpt_oss", "smollm3", "olmo3", "deepseek_v3")
FAMILIES += ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# The hybrid families' defaults: linear-attention layers with grouped value heads (4 value heads
# per 2 query/key heads), a conv of 4 taps, partial rotary on the full-attention layers, which
# are every fourth layer (``layer_types``), as in released checkpoints.
HYBRID_DEFAULTS: dict[str, dict] = {
    "qwen3_5": {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
    },
}
HYBRID_DEFAULTS["qwen3_5_moe"] = HYBRID_DEFAULTS["qwen3_next"] = HYBRID_DEFAULTS["qwen3_5"]
# Gemma's defaults (``build_tiny_model``'s ``sliding_window`` overrides the window): a window
# shorter than most test prompts, sliding and full layers alternating, a query scale and
# (Gemma 2) soft caps small enough to change the output, Gemma 3's two RoPE bases far apart.
GEMMA_DEFAULTS: dict[str, dict] = {
    "gemma2": {
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 8.0,
        "final_logit_softcapping": 12.0,
    },
    "gemma3": {
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        },
    },
}
# Gemma 4 (dense) with every part on: full layers with other KV heads and head size than the
# sliding ones (V from the key projection), proportional RoPE on them, the last two layers
# reading earlier layers' KV with double-wide MLPs, per-layer input embeddings, a soft cap.
GEMMA_DEFAULTS["gemma4"] = {
    "num_hidden_layers": 4,
    "sliding_window": 8,
    "global_head_dim": 48,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 8,
    "final_logit_softcapping": 12.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
    },
}
# OLMo 3's: a short window, sliding and full layers alternating, the full layers' RoPE YaRN
# (as the released long-context models set it), the sliding layers' plain with the same base.
OLMO3_DEFAULTS: dict[str, dict] = {
    "olmo3": {
        "sliding_window": 8,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "full_attention": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        },
    },
}
# The mixture-of-experts families' defaults (``build_tiny_model``'s ``moe`` overrides them):
# few, small experts, two per token, so a test run stays fast and most experts get tokens.
MOE_DEFAULTS: dict[str, dict] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    # GLM-4.5's routing with every part turned on: two groups of four experts (one kept), a
    # scaling factor, two shared experts' width, a dense first layer; q/k norm and qkv bias.
    "glm4_moe": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    # gpt-oss's experts are ``intermediate_size`` wide; its window is short, its layers alternate
    # sliding and full, and its RoPE is the released models' YaRN (factor 32 over 4096 positions).
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 8},
    # Grouped routing that bites: 4 groups of 2 experts, the tokens' experts from the best 2
    # groups, a scaling factor far from 1, a dense first layer.
    "deepseek_v3": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
    },
    "qwen3_5_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
    },
    # Qwen3-Next: Qwen3.5-MoE's block, with a dense MLP layer among the sparse ones.
    "qwen3_next": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "mlp_only_layers": [1],
    },
}
# DeepSeek-V3's multi-head latent attention, small: every rank and head width distinct, so a
# projection split at the wrong place fails to load or changes the output.
MLA_DEFAULTS: dict[str, int] = {
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
}
# Architectures we have no forward pass for, which the engine runs through the transformers
# fallback (``conveyor.engine.models.transformers_fallback``), each with what sets it apart from Llama
# turned away from its default so that a head or a scale the fallback drops changes the output.
FALLBACK_FAMILIES: dict[str, dict] = {
    # LayerNorm with biases, parallel residual, fused qkv, partial rotary; no GQA.
    "gpt_neox": {"rotary_pct": 0.5, "layer_norm_eps": 1e-5},
    # Llama with multipliers: attention scaling (not 1/sqrt(head_dim)), embeddings, residuals, logits.
    "granite": {
        "attention_multiplier": 0.3,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "logits_scaling": 4.0,
    },
    # LayerNorm, parallel attention and MLP, interleaved RoPE, a logit scale.
    "cohere": {"logit_scale": 0.5, "layer_norm_eps": 1e-5},
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = [
    *["the", "a", "an", "of", "to", "in", "on", "at", "for", "with", "from", "by", "about", "kitchen"],
    *["table", "order", "guest", "waiter", "chef", "soup", "bread", "wine", "salad", "fish", "rice", "cake"],
    *["tea", "coffee", "water", "menu", "bill", "tip", "seat", "door", "window", "slow", "quick", "hot"],
    *["cold", "sweet", "bitter", "fresh", "warm", "tiny", "large", "early", "late", "always", "never"],
    *["often", "cook", "serve", "bring", "pour", "taste", "wait", "leave", "arrive", "smile", "ask"],
    *["answer", "count", "share", "finish", "token", "batch", "queue", "worker", "engine", "cache", "block"],
    *["page", "prompt", "model", "output", "shard", "job", "one", "two", "three", "four", "five", "six"],
    *["seven", "eight", "nine", "ten", "hundred", "thousand"],
]


def corpus(num_sentences: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}"
        out.append(sentence)
    return out


def build_tokenizer(path: str | Path, family: str = "llama", vocab_size: int = 512):
    """Train and save a byte-level BPE tokenizer; returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    llama_like = family in ("llama", "mistral", "phi3", "mixtral")
    if llama_like:  # these families put BOS in front of every encoded text
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>" if llama_like else None,
        eos_token="</s>" if llama_like else "<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    return fast


def build_tiny_model(
    path: str | Path,
    family: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict | None = None,
    partial_rotary_factor: float | None = None,
    legacy_config: bool = False,
    init_std: float = 0.5,
    moe: dict | None = None,
    mla: dict | None = None,
    sliding_window: int | None = None,
    vocab_size: int | None = None,
    rope_theta: float | None = None,
    save_dtype: torch.dtype = torch.float32,
    overrides: dict | None = None,
) -> Path:
    """Write a random-weight checkpoint (config.json, generation_config.json, safetensors,
    tokenizer) of ``family`` to ``path`` and return the path.

    ``legacy_config`` rewrites config.json in the transformers 4.x spelling
    (``rope_theta``/``rope_scaling``) instead of 5.x (``rope_parameters``). ``moe``: config
    fields over the family's ``MOE_DEFAULTS`` (``decoder_sparse_step``, ``mlp_only_layers``...);
    ``mla``: DeepSeek-V3's latent-attention fields over ``MLA_DEFAULTS``.
    ``sliding_window``: Mistral's window (none by default) or Gemma's (``GEMMA_DEFAULTS``); Gemma's
    layers alternate between sliding (even layers) and full attention. ``vocab_size``: the
    model's vocabulary when larger than the tokenizer's (a real model's embedding shape; the
    extra ids are reachable as token-id prompts). ``save_dtype``: the checkpoint's dtype.
    ``overrides``: config fields set last, over everything above (a released model's own
    hybrid head counts or layer types)."""
    import transformers

    if family not in FAMILIES and family not in FALLBACK_FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES + tuple(FALLBACK_FAMILIES)}, got {family!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, family)
    vocab = max(len(tokenizer), vocab_size or 0)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if family in FALLBACK_FAMILIES:
        fallback_kwargs = {**common, "tie_word_embeddings": bool(tie_word_embeddings), **FALLBACK_FAMILIES[family]}
        if family == "gpt_neox":  # no GQA: it would keep the number as a stray attribute
            del fallback_kwargs["num_key_value_heads"]
        fallback_config = transformers.AutoConfig.for_model(family, **fallback_kwargs)
        eos = [tokenizer.eos_token_id]
        return _save_random(path, fallback_config, tokenizer, seed, init_std, eos, legacy_config, save_dtype)
    config_cls = _config_class(family)
    tie = family in ("qwen2", "qwen3") if tie_word_embeddings is None else tie_word_embeddings
    kwargs = dict(common, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    _add_family_fields(
        kwargs, family, vocab=vocab, num_layers=num_layers, num_heads=num_heads, hidden_size=hidden_size,
        head_dim=head_dim, moe=moe, mla=mla, rope_scaling=rope_scaling, partial_rotary_factor=partial_rotary_factor,
    )  # fmt: skip
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    if partial_rotary_factor is not None:
        kwargs["partial_rotary_factor"] = partial_rotary_factor
    if family == "phi3" and rope_scaling and "original_max_position_embeddings" in rope_scaling:
        # Phi-3 keeps it beside max_position_embeddings; transformers copies it into the rope dict.
        kwargs["original_max_position_embeddings"] = rope_scaling["original_max_position_embeddings"]
    kwargs.update(overrides or {})
    if "intermediate_size" not in config_cls().to_dict():  # (Qwen3.5-MoE: no dense MLP, no such key)
        del kwargs["intermediate_size"]
    config = config_cls(**kwargs)
    if rope_theta is not None:
        _set_rope_theta(config, rope_theta)
    if rope_scaling:
        if partial_rotary_factor is not None:
            rope_scaling = {**rope_scaling, "partial_rotary_factor": partial_rotary_factor}
        _set_rope(config, rope_scaling)
    eos = [tokenizer.eos_token_id]
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"):
        eos.append(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    return _save_random(path, config, tokenizer, seed, init_std, eos, legacy_config, save_dtype)


def _config_class(family: str) -> type:
    """transformers' config class of ``family``."""
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "glm4_moe": transformers.Glm4MoeConfig,
        "gemma4": transformers.Gemma4TextConfig,
        "gpt_oss": transformers.GptOssConfig,
        "smollm3": transformers.SmolLM3Config,
        "olmo3": transformers.Olmo3Config,
        "deepseek_v3": transformers.DeepseekV3Config,
        "qwen3_5": transformers.Qwen3_5TextConfig,
        "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
    }[family]


def _add_family_fields(
    kwargs: dict,
    family: str,
    *,
    vocab: int,
    num_layers: int,
    num_heads: int,
    hidden_size: int,
    head_dim: int | None,
    moe: dict | None,
    mla: dict | None,
    rope_scaling: dict | None,
    partial_rotary_factor: float | None,
) -> None:
    """The config fields ``family`` adds to the common ones (its experts, latent attention,
    layer kinds, head size)."""
    if family in MOE_DEFAULTS or moe:
        kwargs.update({**MOE_DEFAULTS.get(family, {}), **(moe or {})})
    if family == "deepseek_v3":  # every head its own latent projections: no GQA
        kwargs.update({**MLA_DEFAULTS, **(mla or {})}, num_key_value_heads=num_heads)
    if family in GEMMA_DEFAULTS or family in ("gpt_oss", "olmo3"):
        kwargs.update(GEMMA_DEFAULTS.get(family, {}) or OLMO3_DEFAULTS.get(family, {}))
        layers = kwargs["num_hidden_layers"]
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        if family == "gemma4":
            kwargs["vocab_size_per_layer_input"] = vocab
    if family in HYBRID_DEFAULTS:
        kwargs.update(HYBRID_DEFAULTS[family])
        kwargs["layer_types"] = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
        if partial_rotary_factor is None and not rope_scaling:  # (the config's default is 0.25)
            kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    hd_families = (
        "qwen3",
        "qwen3_moe",
        "gemma2",
        "gemma3",
        "gemma4",
        "gpt_oss",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
    )
    if head_dim is not None or family in hd_families:
        kwargs["head_dim"] = head_dim or hidden_size // num_heads
    if family in ("mistral", "phi3", "mixtral"):
        kwargs["sliding_window"] = None
    if family == "smollm3":  # every second layer NoPE, and those sliding (window 8)
        kwargs.update(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8, attention_bias=True)


def _save_random(
    path: Path,
    config,
    tokenizer,
    seed: int,
    init_std: float,
    eos: list[int],
    legacy: bool,
    save_dtype: torch.dtype = torch.float32,
) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()  # (the dtype kwarg is spelt differently in 4.x)
    _randomize(model, init_std)
    model.to(save_dtype).save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(str(path))
    _normalise_config(path / "config.json", legacy)
    return path


@dataclass(frozen=True)
class RealShape:
    """A released model's shape, for random-weight stand-ins at full width (GPU checks and
    benchmarks): same layers, heads, vocabulary and RoPE as the checkpoint, random weights."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768


REAL_SHAPES: dict[str, RealShape] = {
    "qwen3-0.6b": RealShape(
        family="qwen3",
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
    ),
    "llama-3.1-8b": RealShape(
        family="llama",
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
    ),
}
# The same families and head ratios at a size the CPU runs in seconds (the GPU check's dry run).
DRY_RUN_SHAPE = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=1024)


def shaped_model_dir(root: str | Path, name: str, num_layers: int | None = None, *, dry_run: bool = False) -> Path:
    """Where ``build_shaped_model`` keeps ``name`` with ``num_layers`` under ``root``: one name
    per variant, so the GPU check's steps share each checkpoint."""
    layers = f"-{num_layers}layers" if num_layers else ""
    return Path(root) / f"{name}{layers}{'-dry' if dry_run else ''}"


def build_shaped_model(
    path: str | Path,
    name: str,
    *,
    num_layers: int | None = None,
    dry_run: bool = False,
    init_std: float = 0.02,
    save_dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A random-weight checkpoint with ``REAL_SHAPES[name]``'s shape (``num_layers``: fewer
    layers than the real model, every width kept), built once: an existing one is reused.
    ``init_std`` 0.02 is transformers' own init, so activations have a real model's scale.
    ``dry_run``: the family at ``DRY_RUN_SHAPE`` and 2 layers, the init scaled up with the
    narrower width so that activations keep the real shape's scale."""
    if name not in REAL_SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(REAL_SHAPES)}")
    path = Path(path)
    if (path / "config.json").exists():
        return path
    shape = REAL_SHAPES[name]
    sizes = {
        "hidden_size": shape.hidden_size,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
    }
    if dry_run:
        init_std *= (shape.hidden_size / DRY_RUN_SHAPE["hidden_size"]) ** 0.5
        sizes, num_layers = dict(DRY_RUN_SHAPE), 2
    partial = path.with_name(path.name + ".partial")
    build_tiny_model(
        partial,
        shape.family,
        hidden_size=sizes["hidden_size"],
        num_layers=num_layers or shape.num_layers,
        num_heads=sizes["num_heads"],
        num_kv_heads=sizes["num_kv_heads"],
        head_dim=sizes["head_dim"],
        intermediate_size=sizes["intermediate_size"],
        vocab_size=sizes["vocab_size"],
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_theta=shape.rope_theta,
        rope_scaling=shape.rope_scaling,
        max_position_embeddings=shape.max_position_embeddings,
        init_std=init_std,
        save_dtype=save_dtype,
    )
    partial.rename(path)  # whole or absent: a build killed half-way is not taken for a model
    return path


def build_truncated_draft(target: str | Path, path: str | Path, num_layers: int, upper_scale: float = 1.0) -> Path:
    """A draft model for speculative decoding tests and benchmarks: ``target``'s first
    ``num_layers`` layers, embeddings, final norm and head, with its tokenizer. With
    ``upper_scale`` < 1 the target's layers above them are first scaled down in place (their
    output projections), so that the draft agrees with the target often but not always."""
    from safetensors.torch import load_file, save_file

    target, path = Path(target), Path(path)
    weights = load_file(str(target / "model.safetensors"))
    if upper_scale != 1.0:
        for name, tensor in weights.items():
            if _layer_of(name) >= num_layers and name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.mul_(upper_scale)
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    path.mkdir(parents=True, exist_ok=True)
    for file in target.iterdir():
        if file.name != "model.safetensors":
            (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    kept = {name: tensor for name, tensor in weights.items() if _layer_of(name) < num_layers}
    save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def build_tiny_multimodal_qwen3_5(path: str | Path, text_model: str | Path) -> Path:
    """A multimodal Qwen3.5 checkpoint (``Qwen3_5ForConditionalGeneration``: a tiny random
    vision tower) around the language model of the tiny text checkpoint ``text_model``, whose
    weights and tokenizer it takes as they are."""

    import transformers

    path, text_model = Path(path), Path(text_model)
    text_cfg = json.loads((text_model / "config.json").read_text())
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
    vision.update(out_hidden_size=text_cfg["hidden_size"], num_position_embeddings=16)
    config = transformers.Qwen3_5Config(
        text_config=text_cfg, vision_config=vision, tie_word_embeddings=text_cfg["tie_word_embeddings"]
    )
    _save_around_text_model(transformers.Qwen3_5ForConditionalGeneration, config, path, text_model)
    return path


def _save_around_text_model(model_cls: type, config: Any, path: Path, text_model: Path) -> None:
    """A multimodal checkpoint at ``path``: ``model_cls(config)`` with random towers around the
    text checkpoint ``text_model``'s weights (under ``model.language_model.``) and its tokenizer."""
    import shutil

    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = model_cls(config).float()
    _randomize(model, 0.5)
    text = load_file(str(text_model / "model.safetensors"))
    prefix = "model.language_model."
    renamed = {(k if k == "lm_head.weight" else prefix + k[len("model.") :]): v for k, v in text.items()}
    missing = model.load_state_dict(renamed, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    model.save_pretrained(str(path), safe_serialization=True)
    for name in text_model.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(name, path / name.name)


def build_tiny_multimodal_gemma(path: str | Path, text_model: str | Path, *, released: bool = False) -> Path:
    """A multimodal Gemma 3 or 4 checkpoint (``Gemma3ForConditionalGeneration``: a tiny SigLIP
    tower and projector; ``Gemma4ForConditionalGeneration``: tiny vision and audio towers) around
    the language model of the tiny ``gemma3`` or ``gemma4`` text checkpoint ``text_model``,
    whose weights and tokenizer it takes as they are. transformers saves Gemma 3 under the
    released files' names (``language_model.model.``, ``vision_tower.``); ``released``: its
    ``text_config`` also as released, holding only what differs from the defaults."""

    import transformers

    path, text_model = Path(path), Path(text_model)
    text_cfg = json.loads((text_model / "config.json").read_text())
    tied = text_cfg["tie_word_embeddings"]
    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    if text_cfg["model_type"] == "gemma3_text":
        vision = {**tower, "image_size": 32, "patch_size": 8}
        config: transformers.PreTrainedConfig = transformers.Gemma3Config(
            text_config=text_cfg, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=tied
        )
        model_cls: type = transformers.Gemma3ForConditionalGeneration
    else:
        vision = {**tower, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "position_embedding_size": 64}
        audio = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "output_proj_dims": 32}
        config = transformers.Gemma4Config(
            text_config=text_cfg, vision_config=vision, audio_config=audio, tie_word_embeddings=tied
        )
        model_cls = transformers.Gemma4ForConditionalGeneration
    _save_around_text_model(model_cls, config, path, text_model)
    if released:
        cfg = json.loads((path / "config.json").read_text())
        defaults = transformers.Gemma3TextConfig().to_dict()
        cfg["text_config"] = {
            k: v for k, v in cfg["text_config"].items() if k == "model_type" or defaults.get(k, object()) != v
        }
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def _layer_of(name: str) -> int:
    """The decoder layer a weight belongs to (-1: none, e.g. the embeddings)."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


def _set_rope_theta(config, theta: float) -> None:
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters = {**config.rope_parameters, "rope_theta": theta}
    else:  # transformers 4.x
        config.rope_theta = theta


def _set_rope(config, rope_scaling: dict) -> None:
    if hasattr(config, "rope_parameters") and isinstance(config.rope_parameters, dict):
        theta = config.rope_parameters.get("rope_theta", 10000.0)
        # (over the defaults the config class filled in, such as Phi-3's partial_rotary_factor)
        config.rope_parameters = {**config.rope_parameters, **rope_scaling, "rope_theta": theta}
    else:  # transformers 4.x
        config.rope_scaling = dict(rope_scaling)


def _normalise_config(config_path: Path, legacy: bool) -> None:
    """Write config.json in the 4.x (``legacy``) or 5.x spelling, whichever transformers saved."""
    cfg = json.loads(config_path.read_text())
    params = cfg.get("rope_parameters")
    if legacy and params:
        params = dict(params)
        cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
        cfg["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
        del cfg["rope_parameters"]
    elif not legacy and not params:
        scaling = dict(cfg.pop("rope_scaling", None) or {})
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        cfg["rope_parameters"] = {**scaling, "rope_theta": cfg.pop("rope_theta", 10000.0)}
    config_path.write_text(json.dumps(cfg, indent=2))


@torch.no_grad()
def _randomize(model: torch.nn.Module, std: float) -> None:
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.1)
        elif name.endswith("sinks"):  # gpt-oss: spread like the scores, so that they weigh
            p.normal_(0.0, 2.0)
        else:  # norm weights
            p.uniform_(0.6, 1.4)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # (DeepSeek-V3's and GLM's learnt routing bias: zero by default)
            b.normal_(0.0, std)
        elif name.endswith("layer_scalar"):  # (Gemma 4's, saved with the weights)
            b.uniform_(0.6, 1.4)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m conveyor.testing.tiny_models", description="Build a tiny random-weight model."
    )
    ap.add_argument("--out", required=True, help="directory to write the checkpoint to")
    ap.add_argument("--family", default="llama", choices=FAMILIES + tuple(FALLBACK_FAMILIES))
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if (out / "config.json").exists():
        print(out)
        return
    build_tiny_model(out, args.family, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed)
    print(out)


if __name__ == "__main__":
    main()


def add_sentence_transformers_files(path: str | Path, pooling: str, normalize: bool, max_seq_length: int = 512) -> Path:
    """Make the checkpoint at ``path`` a sentence-transformers model: ``modules.json`` with a
    Transformer, a Pooling module (``last``, ``mean`` or ``cls``) and, with ``normalize``, a
    Normalize module, as ``SentenceTransformer.save`` writes them."""
    path = Path(path)
    flags = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {"word_embedding_dimension": hidden, **{flag: mode == pooling for mode, flag in flags.items()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    return path


# Encoder families (``conveyor.engine.models.bert``): their special tokens (the padding token's id is
# the one XLM-R's positions skip: 1, as in the released checkpoints) and the template the
# tokenizer wraps each text in.
ENCODER_FAMILIES: dict[str, dict] = {
    "bert": {"tokens": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "cls": "[CLS]", "sep": "[SEP]"},
    "xlm-roberta": {"tokens": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "cls": "<s>", "sep": "</s>"},
}


def build_tiny_encoder(
    path: str | Path,
    family: str = "bert",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_positions: int = 512,
    hidden_act: str = "gelu",
    init_std: float = 0.2,
) -> Path:
    """Write a random-weight ``BertModel`` or ``XLMRobertaModel`` checkpoint (as
    sentence-transformers saves one: no prefix, the pooler included) with a BPE tokenizer that
    wraps each text in CLS/SEP, taking inputs of up to ``max_positions`` tokens."""
    import transformers

    if family not in ENCODER_FAMILIES:
        raise ValueError(f"family must be one of {tuple(ENCODER_FAMILIES)}, got {family!r}")
    path = Path(path)
    fast = build_tiny_encoder_tokenizer(path, family, max_positions)
    common = dict(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        hidden_act=hidden_act,
        pad_token_id=fast.pad_token_id,
    )
    model: Any
    if family == "bert":
        model = transformers.BertModel(transformers.BertConfig(max_position_embeddings=max_positions, **common))
    else:  # XLM-R's positions start after the padding id
        positions = max_positions + fast.pad_token_id + 1
        model = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(max_position_embeddings=positions, **common))
    torch.manual_seed(seed)
    model = model.float()
    _randomize(model, init_std)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def build_tiny_encoder_tokenizer(path: str | Path, family: str = "bert", max_positions: int = 512) -> Any:
    """Train and save at ``path`` a BPE tokenizer that wraps each text in ``family``'s CLS/SEP;
    returns the transformers tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    info = ENCODER_FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = info["tokens"]
    tok = Tokenizer(models.BPE(unk_token=specials[3] if family == "xlm-roberta" else "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    cls, sep = info["cls"], info["sep"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B {sep}",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    pad = specials[1] if family == "xlm-roberta" else specials[0]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token=cls,
        sep_token=sep,
        pad_token=pad,
        unk_token=specials[3] if family == "xlm-roberta" else "[UNK]",
        mask_token=specials[4],
        model_max_length=max_positions,
    )
    fast.save_pretrained(str(path))
    return fast
