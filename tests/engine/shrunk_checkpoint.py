"""A random-weight checkpoint from a published ``config.json`` shrunk in size only.

The size fields (widths, layers, heads, experts, vocabulary, and the lists whose length follows
them) are made tiny; every other key is kept as published, and a key the publisher left out
stays out. The conformance tests build one per published file, so the engine reads each
family's config exactly as its publisher wrote it (``tests/data/checkpoints/``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Fields set to a fixed tiny size wherever the published config has them (nested configs too).
_FIXED = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_heads": 2,  # (a vision tower's)
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "hidden_size_per_layer_input": 8,
    "global_head_dim": 32,
    "depth": 1,
}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def shrink_config(cfg: dict, tokenizer_size: int = 0) -> dict:
    """``cfg`` (a published config, maybe a multimodal wrapper) with its sizes made tiny."""
    out = _shrink(cfg, tokenizer_size)
    text = out.get("text_config")
    if isinstance(text, dict):
        out["text_config"] = _shrink(text, tokenizer_size)
        hidden = out["text_config"].get("hidden_size", 64)
        for key in ("vision_config", "audio_config"):
            if isinstance(out.get(key), dict):
                sub = _shrink(out[key], 0, vision=True)
                for name in ("out_hidden_size", "output_proj_dims"):
                    if name in sub:
                        sub[name] = hidden if name == "out_hidden_size" else sub.get("hidden_size", 32)
                out[key] = sub
    return out


def _shrink(cfg: dict, tokenizer_size: int, vision: bool = False) -> dict:
    out = dict(cfg)
    for key, size in _FIXED.items():
        if isinstance(out.get(key), int) and out[key] > 0:
            out[key] = 32 if vision and key == "hidden_size" else size
    if vision and isinstance(out.get("intermediate_size"), int):
        out["intermediate_size"] = 64
    if "qk_rope_head_dim" in cfg and cfg.get("head_dim") == cfg["qk_rope_head_dim"]:  # (DeepSeek's RoPE width)
        out["head_dim"] = out["qk_rope_head_dim"]
    if isinstance(out.get("shared_expert_intermediate_size"), int) and out["shared_expert_intermediate_size"] > 0:
        out["shared_expert_intermediate_size"] = 48
    heads = cfg.get("num_attention_heads")
    for key in ("num_key_value_heads", "num_global_key_value_heads"):
        if isinstance(out.get(key), int) and isinstance(heads, int):
            kv = cfg[key]  # MHA stays MHA, MQA stays MQA, GQA keeps groups
            out[key] = out["num_attention_heads"] if kv == heads else (1 if kv == 1 else 2)
    if isinstance(out.get("linear_num_key_heads"), int):
        keys = int(cfg["linear_num_key_heads"])
        ratio = max(1, int(cfg.get("linear_num_value_heads", keys)) // keys)
        out["linear_num_key_heads"] = 2
        if "linear_num_value_heads" in out:
            out["linear_num_value_heads"] = 2 * ratio
    _shrink_experts(out, cfg)
    if isinstance(out.get("first_k_dense_replace"), int):
        out["first_k_dense_replace"] = min(out["first_k_dense_replace"], 1)
    _shrink_layers(out, cfg, vision)
    _shrink_rope(out)
    if "vocab_size" in out and not vision:
        ids = [i for key in _TOKEN_IDS for i in _ints(cfg.get(key))]
        out["vocab_size"] = max([tokenizer_size, *(i + 1 for i in ids)])
        if "vocab_size_per_layer_input" in out:
            out["vocab_size_per_layer_input"] = out["vocab_size"]
    return out


def _shrink_experts(out: dict, cfg: dict) -> None:
    groups = cfg.get("n_group")
    if isinstance(groups, int) and groups > 1:
        out["n_group"] = min(groups, 4)
        out["topk_group"] = min(int(cfg.get("topk_group") or 1), max(1, out["n_group"] // 2))
    for key in _EXPERT_COUNTS:
        if isinstance(out.get(key), int) and out[key] > 0:
            out[key] = max(8, 4 * int(out.get("n_group") or 1))
    for key in ("num_experts_per_tok", "top_k_experts"):
        if isinstance(out.get(key), int) and out[key] > 2:
            out[key] = 2


def _shrink_layers(out: dict, cfg: dict, vision: bool) -> None:
    """Enough layers to hold every layer kind the published layer lists name (two at least),
    and every list sized per layer cut to them."""
    key = "depth" if vision else "num_hidden_layers"
    layers = cfg.get(key)
    if not isinstance(layers, int):
        return
    if vision:
        out[key] = 1
        if "num_hidden_layers" in out and key != "num_hidden_layers":
            out["num_hidden_layers"] = 1
        return
    per_layer = [v for v in cfg.values() if isinstance(v, list) and len(v) == layers and layers > 1]
    count = 2
    for values in per_layer:
        seen: list = []
        for i, value in enumerate(values):
            if value not in seen:
                seen.append(value)
                count = max(count, i + 1)
    shared = cfg.get("num_kv_shared_layers")
    if isinstance(shared, int) and shared > 0:  # (Gemma 4: shared layers after a full set of kinds)
        out["num_kv_shared_layers"] = count
        count *= 2
    if isinstance(cfg.get("first_k_dense_replace"), int) and cfg["first_k_dense_replace"] > 0:
        count = max(count, 2)
    out[key] = count
    for name, value in cfg.items():
        if isinstance(value, list) and len(value) == layers and layers > 1:
            out[name] = value[:count]
    for name, value in cfg.items():  # (per-layer settings keyed by layer index: Gemma 4's)
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            out[name] = {k: v for k, v in value.items() if int(k) < count}
    if isinstance(cfg.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < count]


def _shrink_rope(out: dict) -> None:
    """RoPE lists sized by the rotary dimension (LongRoPE's factors, M-RoPE's sections)."""
    heads = out.get("num_attention_heads")
    head_dim = out.get("head_dim") or (out["hidden_size"] // heads if heads and "hidden_size" in out else 0)
    for key in ("rope_scaling", "rope_parameters"):
        params = out.get(key)
        if not isinstance(params, dict):
            continue
        params = dict(params)
        partial = float(params.get("partial_rotary_factor") or out.get("partial_rotary_factor") or 1.0)
        half = int(head_dim * partial) // 2
        for name in ("short_factor", "long_factor"):
            if isinstance(params.get(name), list):
                params[name] = params[name][:half]
        section = params.get("mrope_section")
        if isinstance(section, list) and half:
            scaled = [max(1, s * half // sum(section)) for s in section[:-1]]
            params["mrope_section"] = [*scaled, max(0, half - sum(scaled))]
        out[key] = params


def _ints(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def build_shrunk_checkpoint(path: str | Path, published: str | Path, *, seed: int = 0, init_std: float = 0.5) -> Path:
    """A random-weight checkpoint at ``path`` from the published files in ``published``:
    its config.json shrunk (``shrink_config``) and written as such, a trained tokenizer
    (``conveyor.testing.tiny_models``), transformers' model of that config with random weights, and
    the published generation_config.json as it is."""
    import transformers

    from conveyor.testing.tiny_models import _randomize, build_tiny_encoder_tokenizer, build_tokenizer

    path, published = Path(path), Path(published)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((published / "config.json").read_text())
    model_type = str(cfg.get("model_type"))
    encoder = model_type in ("bert", "xlm-roberta")
    tokenizer = build_tiny_encoder_tokenizer(path, model_type) if encoder else build_tokenizer(path, model_type)
    small = shrink_config(cfg, len(tokenizer))
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in small.items() if k != "model_type"})
    torch.manual_seed(seed)
    if encoder:
        model = transformers.AutoModel.from_config(config)
    elif "text_config" in small:  # the multimodal class, saved under the released names
        arch = (small.get("architectures") or [None])[0]
        model_cls = getattr(transformers, arch) if arch else transformers.AutoModelForImageTextToText
        model = model_cls(config) if arch else model_cls.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.float()
    _randomize(model, init_std)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "generation_config.json").unlink(missing_ok=True)
    if (published / "generation_config.json").is_file():
        (path / "generation_config.json").write_text((published / "generation_config.json").read_text())
    (path / "config.json").write_text(json.dumps(small, indent=2) + "\n")
    return path
