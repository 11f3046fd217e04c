"""What each GGUF architecture (llama.cpp's ``general.architecture``) holds, mapped back to
transformers' names and config: the config fields its metadata gives, its tensors' names, and
how its converter changed them. ``conveyor.engine.models.gguf`` reads the file with these.

The architectures llama.cpp had by 2024 (``llama``, ``qwen2``, ``qwen3``, ``phi3``,
``qwen2moe``, ``qwen3moe``, ``gemma2``, ``gemma3``) are read one tensor at a time, kept
quantized where a GEMM kernel multiplies them (``GgufArch.streamed``):

- Llama: Q/K rows permuted for llama.cpp's RoPE (undone here); Mixtral is written as
  ``llama`` with ``llama.expert_count`` set and stacked experts.
- Phi-3 keeps its fused projections (``attn_qkv``; ``ffn_up`` holds gate and up), and
  LongRoPE's factors are the tensors ``rope_factors_long``/``rope_factors_short``.
- Qwen2-MoE's shared expert is ``ffn_*_shexp`` with its gate ``ffn_gate_inp_shexp``.
- Gemma 2 and 3: every RMSNorm weight stored with Gemma's ``1 +`` added (subtracted again:
  our layers add it); four norms per layer (``attn_norm``, ``post_attention_norm``,
  ``ffn_norm`` before the MLP, ``post_ffw_norm``); what the file does not say is taken as
  llama.cpp assumes it (``_gemma_fields``).

The later ones are dequantized as read (renamed, interleaved, merged or reordered in float32):

- SmolLM3: the Llama converter (Q/K rows permuted for llama.cpp's RoPE, undone by ``gguf``);
  the file says nothing of NoPE layers: llama.cpp assumes every 4th layer without RoPE, which
  is transformers' default (``no_rope_layer_interval`` 4), and no sliding window.
- gpt-oss: gate and up split out of the interleaved ``gate_up_proj`` into ``ffn_gate_exps`` and
  ``ffn_up_exps`` (``[experts, inter, hidden]``, biases ``[experts, inter]``), ``down_proj``
  transposed to ``ffn_down_exps`` ``[experts, hidden, inter]``, experts usually MXFP4; the sinks
  are ``attn_sinks``. Layers alternate sliding and full from the first (llama.cpp's pattern 2),
  YaRN from the metadata, the clamped SwiGLU's constants are llama.cpp's (and transformers').
- GLM-4.5 MoE: unpermuted; ``block_count`` counts the multi-token-prediction layers too
  (``nextn_predict_layers``), whose tensors are skipped; the dense first layers
  (``leading_dense_block_count``), sigmoid routing with its correction bias ``exp_probs_b`` and
  the grouped top-k (``expert_group_count``/``expert_group_used_count``).
- DeepSeek-V3 (``deepseek2``): written as one KV head (MQA over the latent); ``kv_b_proj`` is
  split per head into ``attn_k_b`` (``[heads, kv_lora_rank, qk_nope]``, transposed) and
  ``attn_v_b`` (``[heads, v_head_dim, kv_lora_rank]``) for llama.cpp's absorbed decode, merged
  back here (an older file's whole ``attn_kv_b`` is taken as it is); the key and value widths
  are ``key_length_mla``/``value_length_mla``; llama.cpp's RoPE turns neighbouring pairs, which
  is transformers' ``rope_interleave``. Softmax routing (DeepSeek-V2) is refused.
- Qwen3.5 (``qwen35``, and ``qwen35moe`` with Qwen2-MoE's expert names): the linear-attention
  layers' tensors as ``ssm_*``/``attn_qkv``/``attn_gate``, with the converter's changes
  undone: ``ssm_a`` is ``-exp(A_log)``, the conv
  kernel squeezed, every RMSNorm but the gated one stored as ``1 + weight``, and where there
  are more value heads than key heads the value heads reordered from grouped by key head to
  tiled (``_LinearAttentionVReorderBase``); which layers are full from
  ``full_attention_interval``, the shapes from ``ssm_*`` keys. ``qwen3next`` (its fused
  projections not mapped yet) is refused.

Experts written fused (the converter's ``--fuse-gate-up-exps``: ``ffn_gate_up_exps``, gate
rows then up rows) are split back into gate and up for every later architecture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.engine.models.model_config import ModelSpec

# The tensors outside the layers -> transformers' names.
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

Meta = Callable[..., Any]  # ``meta(key, default)``: the file's ``<arch>.<key>`` field
Tensors = Iterator[tuple[str, str, torch.Tensor]]  # (file name, transformers name, float32)

# GGUF tensor names (after ``blk.N.``) -> transformers' names (after ``model.layers.N.``).
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSORS = {
    **_BLOCK,
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's shared expert
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Phi-3's ``ffn_up`` is its fused gate_up projection.
_PHI3_TENSORS = {**_LAYER_TENSORS, "ffn_up": "mlp.gate_up_proj"}
# Gemma's norms: ``ffn_norm`` is the one before the MLP, not Llama's post-attention norm.
_GEMMA_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Whether the router's top-k weights are renormalised, where the file does not say
# (``expert_weights_norm``): as llama.cpp runs each architecture.
_DEFAULT_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}

# llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE``: 1 softmax, 2 sigmoid.
_SIGMOID_GATING = 2

_ATTENTION = {**_BLOCK, "post_attention_norm": "post_attention_layernorm"}
# GLM-4.5 and DeepSeek-V3's sparse layers: router, correction bias, ungated shared experts.
_ROUTED = {
    **_ATTENTION,
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction",  # (``.bias`` -> ``e_score_correction_bias``)
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_ROUTED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# DeepSeek-V3's latent attention (``attn_q`` where there is no q_lora_rank: one projection).
_MLA = {
    **_ROUTED,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
# gpt-oss's experts stay stacked, under names ``_interleave_gpt_oss_experts`` turns into transformers'.
_GPT_OSS = {
    **_ATTENTION,
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Qwen3.5's linear-attention layers (its full ones are ``_ATTENTION``'s).
_QWEN35 = {
    **_ATTENTION,
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt",  # (``.bias`` -> ``dt_bias``)
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Qwen3.5 MoE: Qwen2-MoE's router and gated shared expert beside the experts.
_QWEN35_MOE = {
    **_QWEN35,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


@dataclass(frozen=True)
class GgufArch:
    """One architecture: its model_type, config from the metadata, and tensor names."""

    model_type: str
    config: Callable[[Path, Meta, set[str], dict[str, Any]], dict[str, Any]]
    layer_tensors: dict[str, str]
    # Read one tensor at a time, kept quantized where a kernel can (the older architectures);
    # else dequantized as read, for the transforms below.
    streamed: bool = False
    norm_plus_one: bool = False  # RMSNorm weights stored as Gemma's ``1 + weight``
    longrope_factors: bool = False  # LongRoPE's factors stored as tensors (``rope_factors_*``)
    # The per-expert stacks split into transformers' per-expert tensors (GLM, DeepSeek).
    split_experts: bool = False
    permuted: bool = False  # Q/K rows permuted (llama.cpp's Llama converter)
    merge: Callable[[Tensors, ModelSpec, Path], Tensors] | None = None
    # A tensor's values as transformers holds them (from its GGUF name, weights and the spec).
    transform: Callable[[str, np.ndarray, ModelSpec], np.ndarray] | None = None


def _no_fields(file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


def _yarn(meta: Meta, **extra: Any) -> dict[str, Any]:
    if meta("rope.scaling.type") != "yarn":
        return {}
    return {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": meta("rope.scaling.factor"),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
            "beta_fast": meta("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": meta("rope.scaling.yarn_beta_slow", 1.0),
            **extra,
        }
    }


def _gpt_oss_fields(file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    layers = cfg["num_hidden_layers"]
    return {
        "num_local_experts": meta("expert_count"),
        "num_experts_per_tok": meta("expert_used_count"),
        "intermediate_size": meta("expert_feed_forward_length"),
        "sliding_window": meta("attention.sliding_window"),
        # llama.cpp's gpt-oss: every even layer slides (``set_swa_pattern(2)``)
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers or 0)],
        **_yarn(meta, truncate=False),  # (gpt-oss's YaRN keeps the correction range unrounded)
    }


def _routed_fields(file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5 and DeepSeek-V3's mixture of experts, as transformers names it."""
    gating = meta("expert_gating_func", _SIGMOID_GATING)
    if gating != _SIGMOID_GATING:
        raise ValueError(
            f"{file.name}: expert_gating_func {gating} (softmax routing, DeepSeek-V2) is not supported; "
            f"only sigmoid ({_SIGMOID_GATING})"
        )
    nextn = meta("nextn_predict_layers", 0) or 0
    return {
        "num_hidden_layers": cfg["num_hidden_layers"] - nextn if cfg["num_hidden_layers"] else None,
        "num_nextn_predict_layers": nextn,
        "n_routed_experts": meta("expert_count"),
        "num_experts_per_tok": meta("expert_used_count"),
        "moe_intermediate_size": meta("expert_feed_forward_length"),
        "n_shared_experts": meta("expert_shared_count", 0),
        "first_k_dense_replace": meta("leading_dense_block_count", 0),
        "routed_scaling_factor": meta("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta("expert_weights_norm", False)),
        "n_group": meta("expert_group_count", 1),
        "topk_group": meta("expert_group_used_count", 1),
    }


def _glm4_moe_fields(file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    return {**_routed_fields(file, meta, names, cfg), "use_qk_norm": "blk.0.attn_q_norm.weight" in names}


def _deepseek_fields(file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    rope = meta("rope.dimension_count")
    # (newer files: the MQA widths in key/value_length, the per-head ones in *_mla)
    key = meta("attention.key_length_mla") or meta("attention.key_length")
    value = meta("attention.value_length_mla") or meta("attention.value_length")
    log_mul = meta("rope.scaling.yarn_log_multiplier")
    mscale = {"mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1} if log_mul else {}
    out = {
        **_routed_fields(file, meta, names, cfg),
        "num_key_value_heads": cfg["num_attention_heads"],  # (the file's 1 is the latent's MQA view)
        "partial_rotary_factor": 1.0,  # (the rope part is its own width, qk_rope_head_dim)
        "kv_lora_rank": meta("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key - rope if key and rope else None,
        "v_head_dim": value,
        "head_dim": rope,
        "rope_interleave": True,
        **_yarn(meta, **mscale),
    }
    if meta("attention.q_lora_rank"):  # (none: one query projection, ``attn_q``)
        out["q_lora_rank"] = meta("attention.q_lora_rank")
    return out


def _qwen35_fields(file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    layers, interval = cfg["num_hidden_layers"], meta("full_attention_interval", 4)
    v_heads, inner = meta("ssm.time_step_rank"), meta("ssm.inner_size")
    return {
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers or 0)
        ],
        "linear_conv_kernel_dim": meta("ssm.conv_kernel"),
        "linear_key_head_dim": meta("ssm.state_size"),
        "linear_num_key_heads": meta("ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": inner // v_heads if inner and v_heads else None,
    }


def _qwen35_moe_fields(file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        **_qwen35_fields(file, meta, names, cfg),
        "num_experts": meta("expert_count"),
        "num_experts_per_tok": meta("expert_used_count"),
        "moe_intermediate_size": meta("expert_feed_forward_length"),
        "shared_expert_intermediate_size": meta("expert_shared_feed_forward_length", 0),
        "intermediate_size": cfg["intermediate_size"] or meta("expert_feed_forward_length"),
    }


# llama.cpp's Gemma defaults (llama-model.cpp, ``load_hparams``) for what its converter does
# not write: the layer count of the 27B models, whose query scale is ``hidden / heads`` (the
# others': ``head_dim``), and every n-th layer full, the rest sliding.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA2_DEFAULT_WINDOW = 4096


def _gemma_fields(arch: str, file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's config fields, as transformers names them. llama.cpp's converter writes the
    window, Gemma 2's soft caps and a final soft cap where Gemma 3 has one; the query scale
    (``query_pre_attn_scalar``), which layers slide, and Gemma 3's sliding-layer RoPE base
    (10000, no scaling) are not in the file (read here where a newer file has them:
    ``attention.sliding_window_pattern``, ``rope.freq_base_swa``) and are llama.cpp's defaults."""
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}  # (llama.cpp's GELU: the tanh form)
    if layers == _GEMMA_27B_LAYERS[arch] and hidden and heads:
        out["query_pre_attn_scalar"] = hidden // heads
    else:
        out["query_pre_attn_scalar"] = cfg["head_dim"]
    # llama.cpp: Gemma 2 always slides (4096 unless the file says), Gemma 3 only with a window.
    window = meta("attention.sliding_window", _GEMMA2_DEFAULT_WINDOW if arch == "gemma2" else None)
    if window and layers:
        pattern = meta("attention.sliding_window_pattern", _GEMMA_SLIDING_PATTERN[arch])
        if isinstance(pattern, list):  # one flag per layer: sliding or not
            if len(pattern) != layers:
                raise ValueError(
                    f"{file.name}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                    f"for {layers} layers"
                )
            sliding = [bool(p) for p in pattern]
        else:  # every n-th layer full (0: no layer full)
            sliding = [pattern == 0 or (i + 1) % pattern != 0 for i in range(layers)]
        out["sliding_window"] = window
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if arch == "gemma2":  # llama.cpp's defaults where the file has no soft caps
        out["attn_logit_softcapping"] = meta("attn_logit_softcapping", 50.0)
        out["final_logit_softcapping"] = meta("final_logit_softcapping", 30.0)
    else:
        if meta("final_logit_softcapping"):
            out["final_logit_softcapping"] = meta("final_logit_softcapping")
        out["rope_local_base_freq"] = meta("rope.freq_base_swa", 10_000.0)
    return out


def _phi3_fields(file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's sliding window (its LongRoPE factors are tensors: ``GgufArch.longrope_factors``)."""
    window = meta("attention.sliding_window")
    return {"sliding_window": window} if window else {}


def _stacked_moe_fields(arch: str, file: Path, meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """With ``expert_count`` set, the mixture-of-experts config fields as transformers names
    them (every layer sparse: llama.cpp's layout for these architectures); a ``llama`` file
    with experts is Mixtral."""
    if not meta("expert_count"):
        return {}
    if "blk.0.ffn_gate_exps.weight" not in names:
        raise ValueError(
            f"{file.name}: mixture-of-experts without stacked expert tensors (blk.N.ffn_gate_exps; an older "
            "llama.cpp layout with one tensor per expert) is not supported"
        )
    out: dict[str, Any] = {"num_experts_per_tok": meta("expert_used_count")}
    if arch == "llama":
        out["model_type"] = "mixtral"
        out["num_local_experts"] = meta("expert_count")
        out["intermediate_size"] = meta("expert_feed_forward_length") or meta("feed_forward_length")
        return out
    out.update(
        num_experts=meta("expert_count"),
        moe_intermediate_size=meta("expert_feed_forward_length"),
        norm_topk_prob=bool(meta("expert_weights_norm", _DEFAULT_NORM_TOPK[arch])),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        shared_expert_intermediate_size=meta("expert_shared_feed_forward_length", 0),
        qkv_bias="blk.0.attn_q.bias" in names,
    )
    # Qwen MoE files may give no dense feed-forward length (every layer is sparse).
    out["intermediate_size"] = meta("feed_forward_length") or out["moe_intermediate_size"]
    return out


def _grouped_v_heads(w: np.ndarray, axis: int, k_heads: int, per_k: int, head_dim: int) -> np.ndarray:
    """Value heads from llama.cpp's tiled order (``[k0 v0, k1 v0, ..., k0 v1, ...]``) back to
    transformers' grouped by key head, along ``axis``."""
    shape = list(w.shape)
    tiled = w.reshape(*shape[:axis], per_k, k_heads, head_dim, *shape[axis + 1 :])
    return np.swapaxes(tiled, axis, axis + 1).reshape(shape)


def _qwen35_tensor(name: str, w: np.ndarray, spec: ModelSpec) -> np.ndarray:
    lin = spec.linear_attention
    assert lin is not None  # (every qwen35 spec has its linear-attention shapes)
    part = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
    if name.endswith("norm.weight") and part != "ssm_norm":
        w = w - 1.0  # stored as ``1 + weight``
    if part == "ssm_a":
        w = np.log(-w)  # ``-exp(A_log)``
    elif part == "ffn_gate_inp_shexp":
        w = w.reshape(1, -1)  # the shared expert's gate: one row (llama.cpp may store a vector)
    elif part == "ssm_conv1d":
        w = w[:, None, :]  # (the converter squeezed transformers' [channels, 1, kernel])
    per_k = lin.num_v_heads // lin.num_k_heads
    if per_k == 1:
        return w
    k, v = lin.num_k_heads, lin.v_head_dim
    if part in ("attn_qkv", "ssm_conv1d"):  # the value rows follow q and k
        qk = 2 * k * lin.k_head_dim
        return np.concatenate((w[:qk], _grouped_v_heads(w[qk:], 0, k, per_k, v)))
    if part == "attn_gate":
        return _grouped_v_heads(w, 0, k, per_k, v)
    if part in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
        return _grouped_v_heads(w, 0, k, per_k, 1)
    if part == "ssm_out":
        return _grouped_v_heads(w, 1, k, per_k, v)
    return w


def _interleave_gpt_oss_experts(tensors: Tensors, spec: ModelSpec, file: Path) -> Tensors:
    """llama.cpp's separate gate/up expert tensors back into transformers' interleaved
    ``gate_up_proj [experts, hidden, 2 * inter]`` (and its bias), ``down_proj`` transposed back."""
    pending: dict[str, torch.Tensor] = {}
    for source, name, tensor in tensors:
        stem, _, kind = name.rpartition(".")
        if stem.endswith(".mlp.experts.down_proj") and kind == "bias":
            yield source, f"{stem}_bias", tensor
            continue
        if stem.endswith(".mlp.experts.down_proj"):
            yield source, stem, tensor.transpose(1, 2)
            continue
        if not stem.endswith((".mlp.experts.gate_proj", ".mlp.experts.up_proj")):
            yield source, name, tensor
            continue
        pending[name] = tensor
        block = stem.rpartition(".")[0]
        gate, up = pending.get(f"{block}.gate_proj.{kind}"), pending.get(f"{block}.up_proj.{kind}")
        if gate is None or up is None:
            continue
        del pending[f"{block}.gate_proj.{kind}"], pending[f"{block}.up_proj.{kind}"]
        if kind == "bias":  # [experts, inter] each -> [experts, 2 * inter], gate first in each pair
            yield source, f"{block}.gate_up_proj_bias", torch.stack((gate, up), dim=-1).flatten(1)
        else:  # [experts, inter, hidden] each -> [experts, hidden, 2 * inter]
            yield source, f"{block}.gate_up_proj", torch.stack((gate, up), dim=-1).transpose(1, 2).flatten(2)
    if pending:
        raise ValueError(f"{file.name}: expert gate without its up tensor (or up without gate): {sorted(pending)}")


def _merge_kv_b(tensors: Tensors, spec: ModelSpec, file: Path) -> Tensors:
    """llama.cpp's ``attn_k_b`` (``[heads, rank, nope]``) and ``attn_v_b`` (``[heads, v, rank]``)
    back into ``kv_b_proj`` ``[heads * (nope + v), rank]``."""
    pending: dict[str, torch.Tensor] = {}
    for source, name, tensor in tensors:
        if not name.endswith((".self_attn.k_b_proj.weight", ".self_attn.v_b_proj.weight")):
            yield source, name, tensor
            continue
        pending[name] = tensor
        attn = name.rpartition(".")[0].rpartition(".")[0]  # model.layers.N.self_attn
        k_name, v_name = f"{attn}.k_b_proj.weight", f"{attn}.v_b_proj.weight"
        if k_name not in pending or v_name not in pending:
            continue
        k_b, v_b = pending.pop(k_name), pending.pop(v_name)
        kv_b = torch.cat((k_b.transpose(1, 2), v_b), dim=1)
        yield source, f"{attn}.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1])
    if pending:
        raise ValueError(f"{file.name}: attn_k_b without attn_v_b (or the reverse): {sorted(pending)}")


# In the order refusals list them. Mistral checkpoints are written as ``llama``.
ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch(
        "llama",
        functools.partial(_stacked_moe_fields, "llama"),
        _LAYER_TENSORS,
        streamed=True,
        permuted=True,
    ),
    "qwen2": GgufArch("qwen2", _no_fields, _LAYER_TENSORS, streamed=True),
    "qwen3": GgufArch("qwen3", _no_fields, _LAYER_TENSORS, streamed=True),
    "phi3": GgufArch("phi3", _phi3_fields, _PHI3_TENSORS, streamed=True, longrope_factors=True),
    "qwen2moe": GgufArch(
        "qwen2_moe", functools.partial(_stacked_moe_fields, "qwen2moe"), _LAYER_TENSORS, streamed=True
    ),
    "qwen3moe": GgufArch(
        "qwen3_moe", functools.partial(_stacked_moe_fields, "qwen3moe"), _LAYER_TENSORS, streamed=True
    ),
    "gemma2": GgufArch(
        "gemma2", functools.partial(_gemma_fields, "gemma2"), _GEMMA_TENSORS, streamed=True, norm_plus_one=True
    ),
    "gemma3": GgufArch(
        "gemma3_text", functools.partial(_gemma_fields, "gemma3"), _GEMMA_TENSORS, streamed=True, norm_plus_one=True
    ),
    "smollm3": GgufArch("smollm3", _no_fields, _ATTENTION, permuted=True),
    "gpt-oss": GgufArch(
        "gpt_oss",
        _gpt_oss_fields,
        _GPT_OSS,
        merge=_interleave_gpt_oss_experts,
    ),
    "glm4moe": GgufArch("glm4_moe", _glm4_moe_fields, _ROUTED, split_experts=True),
    "deepseek2": GgufArch(
        "deepseek_v3",
        _deepseek_fields,
        {**_MLA, "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj"},
        split_experts=True,
        merge=_merge_kv_b,
    ),
    "qwen35": GgufArch("qwen3_5_text", _qwen35_fields, _QWEN35, transform=_qwen35_tensor),
    "qwen35moe": GgufArch(
        "qwen3_5_moe_text", _qwen35_moe_fields, _QWEN35_MOE, split_experts=True, transform=_qwen35_tensor
    ),
}
_BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()} | {"mixtral": ARCHITECTURES["llama"]}


def for_model_type(model_type: str) -> GgufArch | None:
    return _BY_MODEL_TYPE.get(model_type)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows: per head, (dim/2, 2) back to (2, dim/2)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _names(arch: GgufArch, name: str, spec: ModelSpec, experts: int) -> list[str] | None:
    """The transformers names a GGUF tensor holds (``None`` for a name we do not know); a layer
    past the decoder's (the multi-token-prediction ones) keeps its GGUF part, for the model to skip."""
    stem, _, kind = name.rpartition(".")
    if name.startswith("blk.") and name.count(".") == 2:  # a tensor without a suffix (``ssm_a``)
        stem, kind = name, ""
    if not stem.startswith("blk."):
        hf = TOP_TENSORS.get(stem)
        return None if hf is None else [f"{hf}.{kind}"]
    _, layer, part = stem.split(".", 2)
    prefix = f"model.layers.{layer}."
    if int(layer) >= spec.num_layers:
        return [f"{prefix}{part}.{kind}"]
    if arch.split_experts and part in _ROUTED_EXPERTS:
        return [f"{prefix}mlp.experts.{e}.{_ROUTED_EXPERTS[part]}.{kind}" for e in range(experts)]
    hf = arch.layer_tensors.get(part)
    if hf is None:
        return None
    if part == "attn_sinks":  # (a parameter without ``.weight`` in transformers)
        return [f"{prefix}{hf}"]
    if part in ("exp_probs_b", "ssm_dt"):  # ``e_score_correction_bias``, ``dt_bias``
        return [f"{prefix}{hf}_{kind}"]
    if part == "ssm_a":  # (``A_log``: a parameter without ``.weight``)
        return [f"{prefix}{hf}"]
    return [f"{prefix}{hf}.{kind}"]


def _unfused(tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """The converter's ``--fuse-gate-up-exps`` stacks (``ffn_gate_up_exps``: gate rows, then up
    rows) as the separate ``ffn_gate_exps`` and ``ffn_up_exps`` it writes by default."""
    for name, w in tensors:
        if ".ffn_gate_up_exps." not in name:
            yield name, w
            continue
        half = w.shape[1] // 2
        yield name.replace(".ffn_gate_up_exps.", ".ffn_gate_exps."), w[:, :half]
        yield name.replace(".ffn_gate_up_exps.", ".ffn_up_exps."), w[:, half:]


def iter_tensors(arch: GgufArch, file: Path, spec: ModelSpec, tensors: Iterable[tuple[str, np.ndarray]]) -> Tensors:
    """(file name, transformers name, float32 tensor) for each dequantized GGUF tensor; a name
    we do not know is passed through as the GGUF name, for the loader to refuse."""
    experts = spec.moe.num_experts if spec.moe is not None else 0

    def renamed() -> Tensors:
        for gguf_name, weights in _unfused(tensors):
            names = _names(arch, gguf_name, spec, experts)
            if arch.transform is not None:
                weights = arch.transform(gguf_name, weights, spec)
            if arch.permuted and ".attn_q." in gguf_name:
                weights = unpermute(weights, spec.num_heads)
            elif arch.permuted and ".attn_k." in gguf_name:
                weights = unpermute(weights, spec.num_kv_heads)
            full = torch.from_numpy(np.array(weights, dtype=np.float32))
            if names is None:
                yield file.name, gguf_name, full
            elif len(names) == 1:
                yield file.name, names[0], full
            else:
                if full.shape[0] != len(names):
                    raise ValueError(
                        f"{file.name}: {gguf_name} stacks {full.shape[0]} experts, the metadata {len(names)}"
                    )
                for name, expert in zip(names, full, strict=True):
                    yield file.name, name, expert

    yield from renamed() if arch.merge is None else arch.merge(renamed(), spec, file)
