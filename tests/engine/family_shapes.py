"""Released models' shapes, shrunk only in depth, as random-weight checkpoints for the GPU
check's end-to-end step (``test_bf16_logits_families.py``); in a dry run the same families
and formats at a tiny width. Each is (the checkpoint the engine loads, the checkpoint and
``from_pretrained`` kwargs transformers' oracle loads: the float weights the format stores).

Numbers from the published configs: Qwen3.5-9B (``test_qwen3_5.py``), gpt-oss-20b, DeepSeek-V2-Lite
(MLA on DeepSeek-V3's code path with q_lora_rank None, as ``helpers.MODEL_CASES``), Qwen3-8B
and Llama-3.1-8B (``conveyor.testing.tiny_models.REAL_SHAPES``). Qwen3.5-35B-A3B: hidden 2048, 256 experts
(top 8) of 512 and the linear attention's 16/32 heads of 128 as the 9B."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from conveyor.testing.tiny_models import build_tiny_model

LINEAR_9B = dict(
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
LINEAR_DRY = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
HYBRID_LAYERS = {"layer_types": ["linear_attention", "full_attention"]}
QWEN3_5_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}}
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class FamilyShape:
    family: str
    real: dict[str, Any]  # build_tiny_model's kwargs at the released width
    dry: dict[str, Any]  # and at a tiny one
    fmt: str = "bf16"  # bf16 | mxfp4 | fp8-block | gguf-q4_k
    transformers_class: str = ""  # the config class transformers must have
    engine: dict[str, Any] = field(default_factory=dict)


FAMILY_SHAPES: dict[str, FamilyShape] = {
    "qwen3.5-9b": FamilyShape(
        "qwen3_5",
        dict(
            hidden_size=4096,
            num_heads=16,
            num_kv_heads=4,
            head_dim=256,
            intermediate_size=12288,
            vocab_size=248320,
            overrides={**LINEAR_9B, **HYBRID_LAYERS, **QWEN3_5_ROPE},
        ),
        dict(
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            intermediate_size=128,
            overrides={**LINEAR_DRY, **HYBRID_LAYERS},
        ),
        transformers_class="Qwen3_5TextConfig",
    ),
    "qwen3.5-35b-a3b": FamilyShape(
        "qwen3_5_moe",
        dict(
            hidden_size=2048,
            num_heads=16,
            num_kv_heads=2,
            head_dim=256,
            vocab_size=248320,
            moe={
                "num_experts": 256,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
            },
            overrides={**LINEAR_9B, **HYBRID_LAYERS, **QWEN3_5_ROPE},
        ),
        dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, overrides={**LINEAR_DRY, **HYBRID_LAYERS}),
        transformers_class="Qwen3_5MoeTextConfig",
    ),
    "gpt-oss-20b": FamilyShape(
        "gpt_oss",
        dict(
            hidden_size=2880,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            vocab_size=201088,
            moe={"num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 2880},
            sliding_window=128,
            rope_theta=150000.0,
            rope_scaling=GPT_OSS_YARN,
            max_position_embeddings=131072,
        ),
        dict(
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            moe={"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 64},
            sliding_window=8,
            rope_scaling={**GPT_OSS_YARN, "original_max_position_embeddings": 64},
            max_position_embeddings=2048,
        ),
        fmt="mxfp4",
        transformers_class="GptOssConfig",
    ),
    "deepseek-v2-lite": FamilyShape(
        "deepseek_v3",
        dict(
            hidden_size=2048,
            num_heads=16,
            intermediate_size=10944,
            vocab_size=102400,
            mla={
                "q_lora_rank": None,
                "kv_lora_rank": 512,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
            },
            moe={
                "n_routed_experts": 64,
                "num_experts_per_tok": 6,
                "moe_intermediate_size": 1408,
                "n_shared_experts": 2,
                "n_group": 1,
                "topk_group": 1,
                "routed_scaling_factor": 1.0,
                "first_k_dense_replace": 1,
            },
        ),
        dict(hidden_size=64, num_heads=4, intermediate_size=128, mla={"q_lora_rank": None}),
        transformers_class="DeepseekV3Config",
    ),
    "qwen3-8b-fp8": FamilyShape(
        "qwen3",
        dict(
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=12288,
            vocab_size=151936,
            tie_word_embeddings=False,
            rope_theta=1_000_000.0,
        ),
        dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256),
        fmt="fp8-block",
        transformers_class="Qwen3Config",
    ),
    "llama-3.1-8b-q4_k": FamilyShape(
        "llama",
        dict(
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            rope_theta=500_000.0,
        ),
        dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256),
        fmt="gguf-q4_k",
        transformers_class="LlamaConfig",
    ),
}
# Two layers: a hybrid's linear and full attention, DeepSeek's dense first layer and an MoE one,
# gpt-oss's sliding and full layers.
NUM_LAYERS = 2


def missing_in_transformers(name: str) -> str | None:
    """Why transformers here cannot be the oracle for ``name``, or None."""
    import transformers

    cls = FAMILY_SHAPES[name].transformers_class
    if not hasattr(transformers, cls):
        return f"transformers {transformers.__version__} has no {cls}"
    return None


def build_family(root: Path, name: str, *, dry_run: bool) -> tuple[str, str, dict[str, Any]]:
    """(engine checkpoint, oracle checkpoint, oracle kwargs), built once under ``root``."""
    shape = FAMILY_SHAPES[name]
    where = Path(root) / f"{name}-{NUM_LAYERS}layers{'-dry' if dry_run else ''}"
    base = where / "bf16"
    if not (base / "config.json").exists():
        kwargs = dict(shape.dry if dry_run else shape.real)
        # transformers' init scale; wider at the tiny width so activations keep a real model's scale
        std = 0.02 * (shape.real["hidden_size"] / shape.dry["hidden_size"]) ** 0.5 if dry_run else 0.02
        partial = base.with_name("bf16.partial")
        build_tiny_model(
            partial, shape.family, num_layers=NUM_LAYERS, init_std=std, save_dtype=torch.bfloat16, **kwargs
        )
        partial.rename(base)
    if shape.fmt == "bf16":
        return str(base), str(base), {}
    if shape.fmt == "fp8-block":
        return _fp8_block(base, where, dry_run)
    if shape.fmt == "mxfp4":
        return _mxfp4(base, where)
    return _gguf_q4_k(base, where)


def _fp8_block(base: Path, where: Path, dry_run: bool) -> tuple[str, str, dict[str, Any]]:
    from tests.engine import quantized_checkpoints as qc

    block = (32, 32) if dry_run else (128, 128)  # Qwen3-8B-FP8's blocks are 128x128
    quantized, reference = where / "fp8" / "quantized", where / "fp8" / "reference"
    if not (quantized / "config.json").exists():
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        qc.write_quantized(base, where / "fp8", config, qc.fp8_block(block))
    return str(quantized), str(reference), {}


def _mxfp4(base: Path, where: Path) -> tuple[str, str, dict[str, Any]]:
    """The released layout, and a float twin holding the experts' MXFP4 values: transformers'
    own MXFP4 loader dequantizes to bf16 whatever dtype is asked, so it cannot be the float32 oracle."""
    import shutil

    from safetensors.torch import load_file, save_file

    from conveyor.kernels.reference import Mxfp4Weight
    from tests.engine import quantized_checkpoints as qc

    released, twin = where / "mxfp4", where / "mxfp4-reference"
    if not (released / "config.json").exists():
        qc.write_released_gpt_oss(base, released)
    if not (twin / "config.json").exists():
        partial = twin.with_name(twin.name + ".partial")
        shutil.copytree(base, partial, ignore=shutil.ignore_patterns("*.safetensors"))
        tensors = load_file(base / "model.safetensors")
        for name, w in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = qc.mxfp4_pack(w)  # [E, out, in / 32, 16], [E, out, in / 32]
                values = Mxfp4Weight(blocks.flatten(-2), scales).dequantize(torch.float32)  # [E, out, in]
                tensors[name] = values.transpose(-2, -1).contiguous().to(w.dtype)
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        partial.rename(twin)
    return str(released), str(twin), {}


def _gguf_q4_k(base: Path, where: Path) -> tuple[str, str, dict[str, Any]]:
    from tests.engine.test_gguf import write_gguf

    out = where / "gguf"
    if not (out / "model.gguf").exists():
        write_gguf(str(base), out, "Q4_K", arch="llama")
    config = json.loads((base / "config.json").read_text())
    assert config["model_type"] == "llama"
    return str(out / "model.gguf"), str(out), {"gguf_file": "model.gguf"}
