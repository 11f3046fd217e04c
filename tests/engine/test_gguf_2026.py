"""GGUF files of the 2026 architectures (SmolLM3, gpt-oss, GLM-4.5 MoE, DeepSeek-V3), written
from tiny random checkpoints the way llama.cpp's ``convert_hf_to_gguf`` writes them (tensors
renamed, permuted, split or stacked, MXFP4 experts; its metadata keys), loaded by us: greedy
tokens are transformers' on the original checkpoint, in float32. A quantized file's checkpoint
holds weights the quantization represents exactly (each weight once through it), so the file
and the checkpoint are the same model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.reference import assert_greedy_match, greedy
from tests.engine.test_gguf import PROMPTS, _permute, _stack_experts

gguf = pytest.importorskip("gguf")


def _round_trip(data: np.ndarray, qtype: Any) -> np.ndarray:
    return gguf.dequantize(gguf.quantize(data, qtype), qtype).reshape(data.shape)


def _gpt_oss_tensors(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """gpt-oss's converter: the interleaved gate_up split into gate and up (transposed to
    ``[experts, inter, hidden]``), down transposed, the sinks as ``.weight``."""
    out: dict[str, np.ndarray] = {}
    for name, tensor in weights.items():
        data = tensor.float().numpy()
        if name.endswith("experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_proj.weight"] = data[..., ::2].transpose(0, 2, 1).copy()
            out[stem + "up_proj.weight"] = data[..., 1::2].transpose(0, 2, 1).copy()
        elif name.endswith("experts.gate_up_proj_bias"):
            stem = name.removesuffix("gate_up_proj_bias")
            out[stem + "gate_proj.bias"], out[stem + "up_proj.bias"] = data[..., ::2].copy(), data[..., 1::2].copy()
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = data.transpose(0, 2, 1).copy()
        elif name.endswith("experts.down_proj_bias"):
            out[name.removesuffix("_bias") + ".bias"] = data
        elif name.endswith("sinks"):
            out[name + ".weight"] = data
        else:
            out[name] = data
    return out


def _gpt_oss_mxfp4_checkpoint(checkpoint: Path) -> None:
    """The experts' weights as MXFP4 holds them (blocks of 32 along the converter's rows)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    mx = gguf.GGMLQuantizationType.MXFP4
    for name, tensor in weights.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            data = tensor.numpy().transpose(0, 2, 1)  # (the converter's layout: blocks along hidden or inter)
            weights[name] = torch.from_numpy(_round_trip(np.ascontiguousarray(data), mx).transpose(0, 2, 1).copy())
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})


def _mla_tensors(weights: dict[str, torch.Tensor], cfg: dict) -> dict[str, np.ndarray]:
    """DeepSeek-V2/V3's converter: each ``kv_b_proj`` split per head into ``k_b`` (transposed)
    and ``v_b`` for the absorbed decode; the correction bias as ``e_score_correction.bias``."""
    out: dict[str, np.ndarray] = {}
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, tensor in weights.items():
        if name.endswith("kv_b_proj.weight"):
            kv_b = tensor.float().view(heads, nope + v, tensor.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2).contiguous().numpy()
            out[name.replace("kv_b_proj", "v_b_proj")] = v_b.contiguous().numpy()
        else:
            out[name] = tensor.float().numpy()
    return out


def _tiled_v_heads(t: torch.Tensor, dim: int, cfg: dict, head_dim: int) -> torch.Tensor:
    """The converter's ``_reorder_v_heads``: value heads grouped by key head -> tiled."""
    k = cfg["linear_num_key_heads"]
    per_k = cfg["linear_num_value_heads"] // k
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], k, per_k, head_dim, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _qwen35_tensors(weights: dict[str, torch.Tensor], cfg: dict) -> dict[str, np.ndarray]:
    """Qwen3.5's converter (``Qwen3NextModel`` and ``_LinearAttentionVReorderBase``): value heads
    tiled, ``A_log`` as ``-exp``, ``dt_bias`` as ``dt_proj.bias``, the conv kernel squeezed,
    RMSNorms but the gated one as ``1 + weight``."""
    out: dict[str, np.ndarray] = {}
    v_dim, qk = cfg["linear_value_head_dim"], 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    for name, t in weights.items():
        t = t.float()
        if ".in_proj_qkv." in name or ".conv1d." in name:
            t = t.squeeze() if ".conv1d." in name else t
            t = torch.cat((t[:qk], _tiled_v_heads(t[qk:], 0, cfg, v_dim)))
        elif ".in_proj_z." in name:
            t = _tiled_v_heads(t, 0, cfg, v_dim)
        elif ".in_proj_a." in name or ".in_proj_b." in name:
            t = _tiled_v_heads(t, 0, cfg, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            t = _tiled_v_heads(t[:, None], 0, cfg, 1)[:, 0]
            t = -torch.exp(t) if name.endswith(".A_log") else t
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif ".out_proj." in name:
            t = _tiled_v_heads(t, 1, cfg, v_dim)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        out[name] = t.contiguous().numpy()
    return out


def _metadata(w: Any, cfg: dict, arch: str, layers: int) -> None:
    """What llama.cpp's ``TextModel`` and the architecture's converter write."""
    heads = cfg["num_attention_heads"]
    rope = cfg["rope_parameters"]
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg.get("intermediate_size", 0))  # (Qwen3.5-MoE has none)
    w.add_head_count(heads)
    w.add_head_count_kv(1 if arch == "deepseek2" else cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(cfg["eos_token_id"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if arch == "deepseek2":
        rank, rot = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        w.add_key_length(rank + rot)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rot)
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_kv_lora_rank(rank)
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_rope_dimension_count(rot)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch in ("qwen35", "qwen35moe"):
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(4)
    if "num_experts_per_tok" not in cfg:
        return
    w.add_expert_count(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen35moe":  # (Qwen2-MoE's converter)
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        return
    if arch == "gpt-oss":
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        return
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    if arch == "glm4moe":
        w.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])


def _fused_gate_up(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The converter's ``--fuse-gate-up-exps``: each layer's stacked gate and up experts as one
    ``gate_up_proj`` stack, gate rows first."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("experts.gate_proj.weight")]:
        up = name.replace("gate_proj", "up_proj")
        out[name.replace("gate_proj", "gate_up_proj")] = np.concatenate((out.pop(name), out.pop(up)), axis=1)
    return out


def write_gguf_2026(checkpoint: Path, out_dir: Path, arch: str, qtype: str = "F32", fuse: bool = False) -> Path:
    """``checkpoint`` as llama.cpp's converter writes ``arch``: 2-D and larger weights as
    ``qtype`` (gpt-oss's experts MXFP4 whatever ``qtype``), norms and vectors F32; ``fuse``
    writes the experts' gate and up as one tensor."""
    from safetensors.torch import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    weights = _stack_experts(load_file(checkpoint / "model.safetensors"))
    layers = cfg["num_hidden_layers"]
    if arch == "glm4moe":  # (the multi-token-prediction layers count as blocks)
        layers += cfg["num_nextn_predict_layers"]
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.TensorNameMap(arch_id, layers)
    if arch == "gpt-oss":
        tensors = _gpt_oss_tensors(weights)
    elif arch == "deepseek2":
        tensors = _mla_tensors(weights, cfg)
    elif arch in ("qwen35", "qwen35moe"):
        tensors = _qwen35_tensors(weights, cfg)
    else:
        tensors = {name: t.float().numpy() for name, t in weights.items()}
    if fuse:
        tensors = _fused_gate_up(tensors)
    out_dir.mkdir(parents=True)
    file = out_dir / "model.gguf"
    w = gguf.GGUFWriter(str(file), arch)
    _metadata(w, cfg, arch, layers)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, data in tensors.items():
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf's TensorNameMap has no {arch} name for {name}"
        if arch == "smollm3" and ".q_proj." in name:
            data = _permute(data, cfg["num_attention_heads"])
        elif arch == "smollm3" and ".k_proj." in name:
            data = _permute(data, cfg["num_key_value_heads"])
        q = gguf.GGMLQuantizationType.MXFP4 if "_exps.weight" in gguf_name and arch == "gpt-oss" else qt
        if data.ndim >= 2 and q != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, gguf.quantize(data, q), raw_dtype=q)
        else:
            w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for tok in checkpoint.glob("*"):
        if tok.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(tok, out_dir / tok.name)
    return file


def _representable(checkpoint: str, out: Path, qtype: str, config: dict[str, Any]) -> Path:
    """A copy of ``checkpoint`` with ``config`` set and its 2-D weights through ``qtype`` once."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    cfg = {**json.loads((out / "config.json").read_text()), **config}
    (out / "config.json").write_text(json.dumps(cfg))
    # One end token, as a GGUF file holds (the Qwen families' generation config adds <|endoftext|>).
    gen = out / "generation_config.json"
    if gen.exists():
        gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": cfg["eos_token_id"]}))
    qt = gguf.GGMLQuantizationType[qtype]
    if qt != gguf.GGMLQuantizationType.F32:
        weights = load_file(out / "model.safetensors")
        for name, tensor in weights.items():
            if tensor.ndim == 2:  # (gpt-oss's 3-D experts go through MXFP4 instead)
                weights[name] = torch.from_numpy(_round_trip(tensor.numpy(), qt))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# SmolLM3 as llama.cpp runs it (every 4th layer NoPE, no window): four layers, the last NoPE.
_SMOLLM3 = {
    "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0],
    "use_sliding_window": False,
    "sliding_window": None,
    "layer_types": ["full_attention"] * 4,
}


@pytest.mark.parametrize(
    ("family", "arch", "qtype", "build", "config"),
    [
        ("smollm3", "smollm3", "F16", {"num_layers": 4}, _SMOLLM3),
        ("gpt_oss", "gpt-oss", "F32", {}, {}),
        ("glm4_moe", "glm4moe", "Q8_0", {}, {}),
        ("deepseek_v3", "deepseek2", "F32", {}, {}),
        # three linear-attention layers (two value heads per key head: reordered), then a full one
        ("qwen3_5", "qwen35", "F32", {"num_layers": 4}, {}),
        # with the experts' gate and up fused (ffn_gate_up_exps), as --fuse-gate-up-exps writes them
        ("qwen3_5_moe", "qwen35moe", "F32-fused", {"num_layers": 4}, {}),
    ],
)
def test_gguf_2026_matches_transformers_on_the_original(
    family, arch, qtype, build, config, tiny_models, hf_reference, tmp_path, make_llm
):
    qtype, fuse = qtype.removesuffix("-fused"), qtype.endswith("-fused")
    path = _representable(tiny_models(family, **build), tmp_path / "hf", qtype, config)
    if family == "gpt_oss":
        _gpt_oss_mxfp4_checkpoint(path)
    file = write_gguf_2026(path, tmp_path / "m", arch, qtype, fuse)
    llm = make_llm(str(file))
    assert llm.engine.model_spec.model_type == json.loads((path / "config.json").read_text())["model_type"]
    hf = hf_reference(str(path))
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], greedy([12] * len(PROMPTS)))
    for i, (ids, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        assert_greedy_match(out.token_ids, hf.greedy(ids, 12), f"{family}/{qtype} prompt {i}")


def test_gguf_2026_refusals_name_the_problem(tmp_path):
    """DeepSeek-V2's softmax routing, Qwen3-Next's architecture and a file whose vocabulary
    transformers cannot make a tokenizer of (with none beside it) are refused at load, named."""
    from conveyor.engine.models.loader import check_checkpoint, load_tokenizer
    from tests.engine.test_gguf import stub_gguf

    def softmax_routing(w: Any) -> None:
        w.add_block_count(1)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)

    stub_gguf(tmp_path / "v2.gguf", "deepseek2", {"token_embd.weight": (4, 4)}, softmax_routing)
    with pytest.raises(ValueError, match=r"v2\.gguf: expert_gating_func 1 \(softmax routing, DeepSeek-V2\)"):
        check_checkpoint(tmp_path / "v2.gguf")
    # No tokenizer files beside a file whose vocabulary transformers cannot read: say what to do.
    (tmp_path / "alone").mkdir()
    stub_gguf(tmp_path / "alone" / "m.gguf", "deepseek2", {"token_embd.weight": (4, 4)}, lambda w: w.add_block_count(1))
    with pytest.raises(ValueError, match=r"m\.gguf: transformers cannot build a tokenizer .* tokenizer files"):
        load_tokenizer(tmp_path / "alone" / "m.gguf")
    stub_gguf(tmp_path / "next.gguf", "qwen3next", {"token_embd.weight": (4, 4)}, lambda w: w.add_block_count(1))
    with pytest.raises(ValueError, match=r"GGUF architecture 'qwen3next' is not supported"):
        check_checkpoint(tmp_path / "next.gguf")
