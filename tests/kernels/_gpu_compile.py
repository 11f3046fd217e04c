"""Compile the Triton kernels to CUDA cubins without a GPU (run as a script with
TRITON_INTERPRET=0): catches kernels that work in the interpreter but do not compile,
and register spills in the main attention configurations. Prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from conveyor.kernels.fused_moe import _down_weighted_kernel, _gate_up_kernel, choose_tiles
from conveyor.kernels.fused_ops import _rms_norm_kernel, _silu_and_mul_kernel
from conveyor.kernels.kv_cache_write import _write_kv_cache_kernel
from conveyor.kernels.mla_decode import BLOCK_H, NUM_WARPS, TILE_N, _mla_decode_kernel
from conveyor.kernels.paged_attention import _paged_attn_kernel, _pick_tiles, _reduce_splits_kernel

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


def _compile(fn, types, consts, target, div16=(), **opts):
    """Like a launch would: pointers and the named ints marked 16-divisible."""
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {
        (fn.arg_names.index(n),): [["tt.divisibility", 16]]
        for n in fn.arg_names
        if n in div16 or sig[n].startswith("*")
    }
    src = ASTSource(
        fn=fn, signature=sig, attrs=attrs, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}
    )
    return triton.compile(src, target=target, options=opts)


def _spill_bytes(kernel) -> int | None:
    if not CUOBJDUMP.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    for tok in out.split():
        if tok.startswith("STACK:"):
            return int(tok[6:])
    return None


def attention(dt, arch, group, head_dim, max_query_len, splits, window=0, softcap=0.0, sinks=False, fp8=False):
    """``fp8``: an e4m3 KV cache, of the e4m3 type on sm_89+ and read as bytes before."""
    kv_fp8 = 0 if not fp8 else (1 if arch >= 89 else 2)
    cache = {0: "*" + dt, 1: "*fp8e4nv", 2: "*u8"}[kv_fp8]
    g_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    bm, tn, nw, ns = _pick_tiles(max_query_len, g_pad, d_pad, ELEM[dt], kv_fp8 == 2)
    ptr = "*" + dt
    part = "*fp32" if splits > 1 else ptr
    types = dict(
        q_ptr=ptr,
        k_cache_ptr=cache,
        v_cache_ptr=cache,
        block_tables_ptr="*i32",
        query_start_loc_ptr="*i32",
        seq_lens_ptr="*i32",
        out_ptr=ptr,
        part_out_ptr=part,
        part_lse_ptr=part,
        sinks_ptr=ptr,
        scale_log2e="fp32",
    )
    consts = dict(
        BLOCK_SIZE=16,
        G=group,
        G_PAD=g_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=d_pad,
        BLOCK_Q=bm // g_pad,
        BLOCK_M=bm,
        TILE_N=tn,
        NUM_SPLITS=splits,
        IEEE_DOT=dt == "fp32",
        SLIDING_WINDOW=window,  # constants of the kernel: 0 compiles the code without a window
        SOFTCAP=softcap,
        HAS_SINKS=sinks,
        KV_FP8=kv_fp8,
    )
    strides = [n for n in _paged_attn_kernel.arg_names if n.startswith("stride_")]
    strides.remove("stride_bt")
    k = _compile(
        _paged_attn_kernel, types, consts, GPUTarget("cuda", arch, 32), div16=strides, num_warps=nw, num_stages=ns
    )
    return dict(
        kernel="paged_attention",
        dtype=dt,
        arch=arch,
        group=group,
        head_dim=head_dim,
        max_query_len=max_query_len,
        splits=splits,
        window=window,
        softcap=softcap,
        sinks=sinks,
        kv_fp8=kv_fp8,
        config=[bm, tn, nw, ns],
        shared=k.metadata.shared,
        spill=_spill_bytes(k),
    )


def mla(dt, arch, rank, rope, splits):
    """The MLA decode kernel at a latent width (DeepSeek-V3: rank 512, rope 64)."""
    ptr = "*" + dt
    types = dict(
        q_ptr=ptr,
        cache_ptr=ptr,
        block_tables_ptr="*i32",
        seq_lens_ptr="*i32",
        out_ptr="*fp32" if splits > 1 else ptr,
        lse_ptr="*fp32",
        scale_log2e="fp32",
    )
    consts = dict(
        BLOCK_SIZE=16,
        RANK=rank,
        RANK_PAD=triton.next_power_of_2(rank),
        ROPE=rope,
        ROPE_PAD=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=BLOCK_H,
        TILE_N=TILE_N,
        NUM_SPLITS=splits,
        IEEE_DOT=dt == "fp32",
    )
    strides = [n for n in _mla_decode_kernel.arg_names if n.startswith("stride_")]
    k = _compile(_mla_decode_kernel, types, consts, GPUTarget("cuda", arch, 32), div16=strides, num_warps=NUM_WARPS)
    return dict(
        kernel="mla_decode",
        dtype=dt,
        arch=arch,
        rank=rank,
        rope=rope,
        splits=splits,
        shared=k.metadata.shared,
        spill=_spill_bytes(k),
    )


def others(arch):
    t = GPUTarget("cuda", arch, 32)
    for sinks in (False, True):
        _compile(
            _reduce_splits_kernel,
            dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", sinks_ptr="*bf16"),
            dict(NUM_SPLITS=5, SPLITS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_H=4, HAS_SINKS=sinks),
            t,
            num_warps=4,
        )
    # The KV write into a bf16 cache and an FP8 one (the e4m3 type, or bytes encoded before sm_89).
    fp8_cache, encode = ("*fp8e4nv", False) if arch >= 89 else ("*u8", True)
    for cache, enc in (("*bf16", False), (fp8_cache, encode)):
        _compile(
            _write_kv_cache_kernel,
            dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr=cache, v_cache_ptr=cache, slot_ptr="*i64"),
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, ENCODE_E4M3=enc),
            t,
            num_warps=4,
        )
    _compile(
        _rms_norm_kernel,
        dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", eps="fp32"),
        dict(HAS_RESIDUAL=True, BLOCK=4096),
        t,
        num_warps=16,
    )
    _compile(_silu_and_mul_kernel, dict(x_ptr="*bf16", out_ptr="*bf16"), dict(BLOCK=1024), t, num_warps=4)
    return dict(kernel="others", arch=arch)


def moe(dt, arch, num_tokens, top_k, num_experts, variant="silu"):
    """Both fused-MoE kernels with the tiles ``choose_tiles`` picks for this batch shape.
    ``variant``: ``silu`` (Mixtral's, Qwen's: gate then up rows, weights ``[experts, out, in]``),
    ``gpt_oss`` (clamped SwiGLU over interleaved rows, biases, the weights read through
    transformers' ``[experts, in, out]``), ``gpt_oss_mxfp4`` (that, with MXFP4 weights)."""
    gpt_oss, fp4 = variant != "silu", variant == "gpt_oss_mxfp4"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    tiles = choose_tiles(num_tokens, top_k, num_experts, dtype, gpt_oss)
    ptr = "*" + dt
    consts = dict(
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        HAS_BIAS=gpt_oss,
        W_MXFP4=fp4,
        IEEE_DOT=dt == "fp32",
    )
    # A launch specializes integers equal to 1 as constants: the unit stride of each layout.
    unit = {"stride_wk": 1} if variant != "gpt_oss" else {"stride_wn": 1}
    strides = {"stride_wn", "stride_wk", "stride_we", "stride_se", "stride_sn", "stride_be"} - set(unit)
    weight = "*u8" if fp4 else ptr
    opts = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    t = GPUTarget("cuda", arch, 32)
    gate_up = _compile(
        _gate_up_kernel,
        dict(
            x_ptr=ptr,
            w13_ptr=weight,
            w13_scales_ptr="*u8" if fp4 else ptr,
            b13_ptr=ptr,
            act_ptr=ptr,
            sorted_ids_ptr="*i32",
            block_expert_ptr="*i32",
            alpha="fp32",
            limit="fp32",
        ),
        {**consts, **unit, "TOP_K": top_k, "ACTIVATION": int(gpt_oss)},
        t,
        div16=("inter", "hidden", "stride_xt", "stride_ar", *strides),
        **opts,
    )
    down = _compile(
        _down_weighted_kernel,
        dict(
            act_ptr=ptr,
            w2_ptr=weight,
            w2_scales_ptr="*u8" if fp4 else ptr,
            b2_ptr=ptr,
            out_ptr=ptr,
            topk_weights_ptr="*fp32",
            sorted_ids_ptr="*i32",
            block_expert_ptr="*i32",
        ),
        {**consts, **unit},
        t,
        div16=("hidden", "inter", "stride_ar", "stride_or", *strides),
        **opts,
    )
    return [
        dict(
            kernel=f"fused_moe/{name}",
            variant=variant,
            dtype=dt,
            arch=arch,
            config=[tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps, tiles.num_stages],
            shared=k.metadata.shared,
            spill=_spill_bytes(k),
        )
        for name, k in (("gate_up", gate_up), ("down", down))
    ]


def main():
    results = []
    # (dtype, tokens, top_k, experts): decode and prefill tiles, Mixtral- and Qwen3-MoE-like.
    for dt, tokens, top_k, experts in [
        ("bf16", 8, 2, 8),
        ("bf16", 4096, 2, 8),
        ("bf16", 64, 8, 128),
        ("bf16", 4096, 8, 128),
        ("fp16", 4096, 2, 8),
        ("fp32", 4096, 2, 8),
    ]:
        for arch in (90, 80):
            results.extend(moe(dt, arch, tokens, top_k, experts))
    # (dtype, group, head_dim, max_query_len, splits, archs)
    configs = [
        ("bf16", 4, 128, 1, 1, (90, 80)),  # Llama-3-8B decode
        ("bf16", 4, 128, 1, 8, (90,)),  # ... split-KV
        ("bf16", 4, 128, 512, 1, (90, 86, 80)),  # ... prefill
        ("bf16", 8, 128, 8, 1, (90, 86)),  # 64 packed rows
        ("fp16", 1, 64, 1, 1, (90,)),  # MHA decode, small head
        ("fp16", 1, 64, 512, 1, (90, 80)),  # MHA prefill, small head
        ("bf16", 2, 256, 512, 1, (90, 86)),  # head_dim 256 prefill
        ("bf16", 3, 80, 1, 4, (90,)),  # odd group and head_dim, split-KV
        ("fp32", 4, 128, 1, 1, (90, 86)),
        ("fp32", 4, 128, 512, 1, (90, 86)),
    ]
    for arch in (90, 80):
        results.append(others(arch))
    for dt, group, head_dim, mql, splits, archs in configs:
        for arch in archs:
            results.append(attention(dt, arch, group, head_dim, mql, splits))
    # Gemma 2 9B-like layers: a 4096-token window and a soft cap of 50 on the scores.
    for mql, splits in ((1, 1), (1, 8), (512, 1)):
        results.append(attention("bf16", 90, 2, 256, mql, splits, window=4096, softcap=50.0))
    # gpt-oss's layers (64 query heads over 8 KV heads, head_dim 64): sinks, with and without
    # its 128-token window, decode (whole and split) and prefill.
    for mql, splits, window in ((1, 1, 0), (1, 8, 0), (512, 1, 0), (1, 1, 128), (512, 1, 128)):
        for arch in (90, 80):
            results.append(attention("bf16", arch, 8, 64, mql, splits, window=window, sinks=True))
    # An FP8 KV cache: Llama-3-8B-like decode (whole and split) and prefill, gpt-oss's sinks and
    # window, Gemma 2's window and soft cap.
    for arch in (90, 80):
        for mql, splits in ((1, 1), (1, 8), (512, 1)):
            results.append(attention("bf16", arch, 4, 128, mql, splits, fp8=True))
        results.append(attention("bf16", arch, 8, 64, 1, 1, window=128, sinks=True, fp8=True))
        results.append(attention("bf16", arch, 2, 256, 512, 1, window=4096, softcap=50.0, fp8=True))
        results.append(attention("fp16", arch, 1, 64, 1, 1, fp8=True))
    # DeepSeek-V3's latent attention (rank 512, rope 64), whole and with split keys.
    for dt, splits in (("bf16", 1), ("bf16", 4), ("fp16", 1)):
        for arch in (90, 80):
            results.append(mla(dt, arch, 512, 64, splits))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
