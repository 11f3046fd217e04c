"""GGUF names and metadata of the 2026 architectures llama.cpp's format names: ``smollm3``,
``gpt-oss``, ``glm4moe``, ``deepseek2`` (DeepSeek-V3 and its descendants), ``qwen35`` and
``qwen35moe``, as llama.cpp's ``convert_hf_to_gguf`` writes them, mapped back to transformers'
names and config.

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
rows then up rows) are split back into gate and up for every architecture here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.engine.models.model_config import ModelSpec

# The tensors outside the layers -> transformers' names (``conveyor.engine.models.gguf`` reads them too).
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

Meta = Callable[..., Any]  # ``meta(key, default)``: the file's ``<arch>.<key>`` field
Tensors = Iterator[tuple[str, str, torch.Tensor]]  # (file name, transformers name, float32)

# llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE``: 1 softmax, 2 sigmoid.
_SIGMOID_GATING = 2

_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
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


ARCHITECTURES: dict[str, GgufArch] = {
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
_BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}


def for_model_type(model_type: str) -> GgufArch | None:
    return _BY_MODEL_TYPE.get(model_type)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
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
                weights = _unpermute(weights, spec.num_heads)
            elif arch.permuted and ".attn_k." in gguf_name:
                weights = _unpermute(weights, spec.num_kv_heads)
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
