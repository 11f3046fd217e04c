"""Which kernel cases the GPU check runs, most valuable first: the kernels that never ran on a
GPU at their released models' shapes, and (``dry``) the same list at tiny shapes in float32
(Triton's interpreter computes bf16 wrongly) for the CPU dry run."""

from __future__ import annotations

import torch

from benchmarks.gpu_check import kernel_cases as kc
from benchmarks.gpu_check.kernel_cases import Case

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def cases(dry: bool) -> list[Case]:
    """Each case at its real shape, or (``dry``) at a tiny one with the same structure."""
    low = FP32 if dry else BF16
    half = FP16  # the interpreter runs fp16 correctly: these stay fp16 in the dry run too

    def pick(real, tiny):
        return tiny if dry else real

    # Qwen3.5's linear attention: 16 key heads and 32 value heads of 128, conv kernel 4;
    # conv channels 2 * 16 * 128 + 32 * 128 = 8192.
    kh, vh, dk, dv = pick((16, 32, 128, 128), (2, 4, 32, 16))
    conv = pick(8192, 300)
    # gpt-oss-20b's attention: 64 query heads over 8 KV heads of 64, window 128.
    okv, ogrp, ohd, owin = pick((8, 8, 64, 128), (2, 2, 32, 8))
    ctx = pick(1024, 40)
    dec64 = [(ctx - 1 - 7 * i, 1) for i in range(pick(64, 3))]
    prefill = pick([(0, 1024), (512, 512)], [(0, 21), (13, 9)])
    # Llama-3.1-8B's attention: 32 query heads over 8 KV heads of 128.
    lkv, lgrp, lhd = pick((8, 4, 128), (2, 2, 32))
    # DeepSeek-V2-Lite's MLA: 16 heads, kv_lora_rank 512, qk_rope_head_dim 64.
    mheads, rank, rope = pick((16, 512, 64), (4, 32, 8))
    mla_lens = pick([2048], [40]), pick([1024 - 13 * i for i in range(64)], [40, 17, 3])
    # Experts: gpt-oss-20b (32, top 4, 2880 and 2880); Qwen3.5-35B-A3B (256, top 8, hidden 2048, 512).
    oss: tuple[int, int, int, int] = pick((32, 4, 2880, 2880), (6, 2, 64, 64))
    q35: tuple[int, int, int, int] = pick((256, 8, 2048, 512), (8, 3, 48, 40))
    tokens = pick((1, 64, 1024), (1, 7, 19))
    # Qwen3-8B (hidden 4096, intermediate 12288; gate and up fused) and Llama-3.1-8B (4096, 14336).
    hid, q_inter, l_inter = pick((4096, 12288, 14336), (256, 512, 512))
    block = pick((128, 128), (32, 64))
    m_big = pick(1024, 33)

    def name(kernel: str, model: str, what: str, dtype: torch.dtype) -> str:
        return f"{kernel}/{model}/{what}/{str(dtype)[6:]}"

    def case(kernel: str, model: str, what: str, dtype: torch.dtype, build) -> Case:
        return Case(name(kernel, model, what, dtype), kernel, f"{model} {what}", dtype, build)

    lengths = pick([1536, 500, 12], [40, 5, 1])
    verify = pick([5] * 16 + [300], [5, 2, 40])
    return [
        case("gated_delta_prefill", "qwen3.5-9b", "2048 tokens", low, kc.delta_prefill(lengths, kh, vh, dk, dv, low)),
        case("gated_delta_decode", "qwen3.5-9b", "batch 64", low, kc.delta_decode(len(dec64), kh, vh, dk, dv, low)),
        case("gated_delta_decode", "qwen3.5-9b", "batch 1", low, kc.delta_decode(1, kh, vh, dk, dv, low)),
        case(
            "gated_delta_snapshots",
            "qwen3.5-35b-a3b",
            "verifications of 5 and a prefill",
            low,
            kc.delta_prefill(verify, kh, vh, dk, dv, low, snapshots=4),
        ),
        case("conv_update", "qwen3.5-9b", "batch 64", low, kc.conv_update(len(dec64), conv, 4, low)),
        case("moe_mxfp4", "gpt-oss-20b", f"{tokens[0]} token", low, kc.moe_mxfp4(tokens[0], *oss, dtype=low)),
        case("moe_mxfp4", "gpt-oss-20b", f"{tokens[1]} tokens", low, kc.moe_mxfp4(tokens[1], *oss, dtype=low)),
        case("moe_mxfp4", "gpt-oss-20b", f"{tokens[2]} tokens", low, kc.moe_mxfp4(tokens[2], *oss, dtype=low)),
        case(
            "attention_sinks",
            "gpt-oss-20b",
            "decode 64 sliding",
            low,
            kc.attention_sinks(dec64, okv, ogrp, ohd, owin, low),
        ),
        case(
            "attention_sinks",
            "gpt-oss-20b",
            "decode 64 full",
            low,
            kc.attention_sinks(dec64, okv, ogrp, ohd, None, low),
        ),
        case(
            "attention_sinks",
            "gpt-oss-20b",
            "prefill sliding",
            low,
            kc.attention_sinks(prefill, okv, ogrp, ohd, owin, low),
        ),
        case(
            "attention_sinks",
            "gpt-oss-20b",
            "decode 64 sliding",
            half,
            kc.attention_sinks(dec64, okv, ogrp, ohd, owin, half),
        ),
        case("mla_decode", "deepseek-v2-lite", "batch 1", low, kc.mla(mla_lens[0], mheads, rank, rope, low)),
        case("mla_decode", "deepseek-v2-lite", "batch 64", low, kc.mla(mla_lens[1], mheads, rank, rope, low)),
        case("fp8_block_gemm", "qwen3-8b", "gate_up m=1", low, kc.fp8_block(1, 2 * q_inter, hid, block, low)),
        case(
            "fp8_block_gemm", "qwen3-8b", f"gate_up m={m_big}", low, kc.fp8_block(m_big, 2 * q_inter, hid, block, low)
        ),
        case("fp8_block_gemm", "qwen3-8b", "down m=64", half, kc.fp8_block(64, hid, q_inter, block, half)),
        case("q4_k_gemm", "llama-3.1-8b", "gate m=1", low, kc.q4_k(1, l_inter, hid, low)),
        case("q4_k_gemm", "llama-3.1-8b", "down m=64", low, kc.q4_k(64, hid, l_inter, low)),
        case("q8_0_gemm", "llama-3.1-8b", "gate m=1", low, kc.q8_0(1, l_inter, hid, low)),
        case("q8_0_gemm", "llama-3.1-8b", "down m=64", low, kc.q8_0(64, hid, l_inter, low)),
        case("w4a16_gemm", "llama-3.1-8b", "gate m=1 g128", low, kc.w4a16(1, l_inter, hid, 128, low)),
        case("w4a16_gemm", "llama-3.1-8b", f"down m={m_big} g128", low, kc.w4a16(m_big, hid, l_inter, 128, low)),
        case("fp8_kv_scaled", "llama-3.1-8b", "decode 64", low, kc.fp8_kv_scaled(dec64, lkv, lgrp, lhd, low)),
        case("fp8_kv_scaled", "llama-3.1-8b", "prefill", low, kc.fp8_kv_scaled(prefill, lkv, lgrp, lhd, low)),
        case("w8a8_scaled_mm", "llama-3.1-8b", "gate m=1", low, kc.w8a8(1, l_inter, hid, low)),
        case("w8a8_scaled_mm", "llama-3.1-8b", f"gate m={m_big}", low, kc.w8a8(m_big, l_inter, hid, low)),
        case("moe_bf16", "qwen3.5-35b-a3b", f"{tokens[0]} token", low, kc.moe_dense(tokens[0], *q35, dtype=low)),
        case("moe_bf16", "qwen3.5-35b-a3b", f"{tokens[1]} tokens", low, kc.moe_dense(tokens[1], *q35, dtype=low)),
        case("moe_bf16", "qwen3.5-35b-a3b", "2048 tokens", low, kc.moe_dense(pick(2048, 19), *q35, dtype=low)),
    ]
