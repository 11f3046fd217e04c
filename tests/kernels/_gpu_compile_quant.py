"""Compile the quantized GEMM kernels to CUDA cubins without a GPU (run as a script with
TRITON_INTERPRET=0), as ``_gpu_compile.py`` does for the others. Prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton.backends.compiler import GPUTarget

from conveyor.kernels.quant_gemm import (
    Q8_0_BLOCK,
    _fp8_block_gemm_kernel,
    _q4_k_gemm_kernel,
    _q8_0_gemm_kernel,
    _w4a16_gemm_kernel,
    choose_tiles,
)
from tests.kernels._gpu_compile import _compile, _spill_bytes


def w4a16(dt: str, arch: int, m: int, group_size: int) -> dict:
    bm, bn, bk, warps = choose_tiles(m, group_size)
    types = dict(x_ptr="*" + dt, qweight_ptr="*i32", scales_ptr="*" + dt, zeros_ptr="*u8", out_ptr="*" + dt)
    consts = dict(GROUP_SIZE=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE_DOT=False)
    strides = [n for n in _w4a16_gemm_kernel.arg_names if n.startswith("stride_")] + ["K", "N"]
    k = _compile(_w4a16_gemm_kernel, types, consts, GPUTarget("cuda", arch, 32), div16=strides, num_warps=warps)
    return dict(
        kernel="w4a16_gemm",
        dtype=dt,
        arch=arch,
        group_size=group_size,
        config=[bm, bn, bk, warps],
        shared=k.metadata.shared,
        spill=_spill_bytes(k),
    )


def fp8_block(dt: str, arch: int, m: int, block: tuple[int, int]) -> dict:
    """sm_90 reads the e4m3 type; sm_80 has none and decodes the bytes (``DECODE_E4M3``)."""
    bm, bn, bk, warps = choose_tiles(m, block[1])
    decode = arch < 89
    types = dict(x_ptr="*" + dt, w_ptr="*u8" if decode else "*fp8e4nv", scale_ptr="*fp32", out_ptr="*" + dt)
    consts = dict(
        SCALE_BLOCK_N=block[0],
        SCALE_BLOCK_K=block[1],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE_DOT=False,
        DECODE_E4M3=decode,
    )
    strides = [n for n in _fp8_block_gemm_kernel.arg_names if n.startswith("stride_")] + ["K", "N"]
    k = _compile(_fp8_block_gemm_kernel, types, consts, GPUTarget("cuda", arch, 32), div16=strides, num_warps=warps)
    return dict(
        kernel="fp8_block_gemm",
        dtype=dt,
        arch=arch,
        block=list(block),
        config=[bm, bn, bk, warps],
        shared=k.metadata.shared,
        spill=_spill_bytes(k),
    )


def q8_0(dt: str, arch: int, m: int) -> dict:
    bm, bn, bk, warps = choose_tiles(m, Q8_0_BLOCK)
    types = dict(x_ptr="*" + dt, qs_ptr="*i8", d_ptr="*fp16", out_ptr="*" + dt)
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE_DOT=False)
    strides = [n for n in _q8_0_gemm_kernel.arg_names if n.startswith("stride_")] + ["K", "N"]
    k = _compile(_q8_0_gemm_kernel, types, consts, GPUTarget("cuda", arch, 32), div16=strides, num_warps=warps)
    return dict(
        kernel="q8_0_gemm",
        dtype=dt,
        arch=arch,
        config=[bm, bn, bk, warps],
        shared=k.metadata.shared,
        spill=_spill_bytes(k),
    )


def q4_k(dt: str, arch: int, m: int) -> dict:
    bm, bn, bk, warps = choose_tiles(m, 64)
    types = dict(x_ptr="*" + dt, qs_ptr="*u8", scales_ptr="*u8", d_ptr="*fp16", dmin_ptr="*fp16", out_ptr="*" + dt)
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE_DOT=False)
    strides = [n for n in _q4_k_gemm_kernel.arg_names if n.startswith("stride_")] + ["K", "N"]
    k = _compile(_q4_k_gemm_kernel, types, consts, GPUTarget("cuda", arch, 32), div16=strides, num_warps=warps)
    return dict(
        kernel="q4_k_gemm",
        dtype=dt,
        arch=arch,
        config=[bm, bn, bk, warps],
        shared=k.metadata.shared,
        spill=_spill_bytes(k),
    )


if __name__ == "__main__":
    results = [
        w4a16(dt, arch, m, group)
        for arch in (90, 80)
        for dt in ("bf16", "fp16")
        for m in (1, 256)
        for group in (32, 128)
    ]
    results += [fp8_block(dt, arch, m, (128, 128)) for arch in (90, 80) for dt in ("bf16", "fp16") for m in (1, 256)]
    results += [q8_0(dt, arch, m) for arch in (90, 80) for dt in ("bf16", "fp16") for m in (1, 256)]
    results += [q4_k(dt, arch, m) for arch in (90, 80) for dt in ("bf16", "fp16") for m in (1, 256)]
    print(json.dumps(results))
