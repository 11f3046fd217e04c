"""The quantized-weight Triton GEMMs vs conveyor.kernels.reference: W4A16 (int4 groups dequantized in
its K loop), block FP8 (e4m3 read as the type, or its bytes decoded as sm_80 needs) and GGUF
Q8_0 and Q4_K (against the gguf library's dequantization), and their compilation for sm_90 and sm_80
without register spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.kernels import reference as ref

from ._helpers import DEVICE, DTYPES, TOL

HERE = Path(__file__).resolve().parent


def _int4_weight(n: int, k: int, group_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for i in range(8):
        words |= q[:, i::8] << (4 * i)
    qweight = (words - ((words >> 31) << 32)).to(torch.int32)
    scales = torch.rand(n, k // group_size, generator=g) * 0.02 + 0.005
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g).to(torch.uint8)
    dense = (q - zeros.long().repeat_interleave(group_size, 1)) * scales.repeat_interleave(group_size, 1)
    return qweight, scales, zeros, dense


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize(("n", "k", "group_size"), [(48, 128, 32), (64, 256, 128), (80, 192, 64)])
def test_w4a16_gemm_matches_the_reference(dtype, m, n, k, group_size):
    from conveyor.kernels.quant_gemm import w4a16_gemm

    qweight, scales, zeros, dense = _int4_weight(n, k, group_size, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    want = ref.w4a16_gemm(x, qweight, scales.to(dtype), zeros, group_size)
    # The reference itself is the dense matmul of the weight the integers stand for.
    torch.testing.assert_close(want.float(), (x.float() @ dense.to(dtype).float().t()).to(dtype).float(), **TOL[dtype])
    got = w4a16_gemm(x.to(DEVICE), qweight.to(DEVICE), scales.to(dtype).to(DEVICE), zeros.to(DEVICE), group_size)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


def test_quant_gemm_kernels_compile_for_gpu_without_spills():
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not available")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, str(HERE / "_gpu_compile_quant.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["kernel"], r["arch"], r["dtype"], r["config"][0]) for r in results} >= {
        (kernel, arch, dt, bm)
        for kernel in ("w4a16_gemm", "fp8_block_gemm", "q8_0_gemm", "q4_k_gemm")
        for arch in (80, 90)
        for dt in ("bf16", "fp16")
        for bm in (16, 64)
    }
    for r in results:
        assert r["shared"] <= 100 * 1024, r
        if r["spill"] is not None:
            assert r["spill"] == 0, f"register spills: {r}"


@pytest.mark.parametrize("decode_e4m3", [False, True], ids=["e4m3-type", "e4m3-decoded"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize(
    ("n", "k", "block"),
    [(96, 256, (128, 128)), (72, 200, (32, 64)), (40, 96, (16, 32)), (64, 80, None)],
    ids=["128x128-edge", "32x64-edge", "16x32", "per-tensor"],
)
def test_fp8_block_gemm_matches_the_reference(dtype, m, n, k, block, decode_e4m3):
    from conveyor.kernels.quant_gemm import fp8_block_gemm

    g = torch.Generator().manual_seed(n + k)
    # Subnormals, normals and the largest values (448) all appear.
    weight = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    weight[0, :4] = torch.tensor([448.0, -448.0, 2.0**-9, -(2.0**-7)]).to(torch.float8_e4m3fn)
    grid = (1, 1) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=g) * 0.01 + 0.001
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = ref.fp8_block_gemm(x, weight, scale, block)
    got = fp8_block_gemm(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), block, decode_e4m3=decode_e4m3)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (80, 160)])
def test_q8_0_gemm_matches_the_gguf_library_dequantization(dtype, m, n, k):
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from conveyor.kernels.gguf_blocks import split_q8_0
    from conveyor.kernels.quant_gemm import q8_0_gemm

    rng = np.random.default_rng(n + k)
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q8_0)
    dense = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32))
    qs, d = split_q8_0(torch.from_numpy(raw))
    # The split keeps the file's bytes: the reference over them is the library's dequantization.
    # Small inputs: outputs of order one, within fp16's absolute tolerance (weights are N(0, 1)).
    x = (0.25 * torch.randn(m, k, generator=torch.Generator().manual_seed(5))).to(dtype)
    want = ref.q8_0_gemm(x, qs, d)
    torch.testing.assert_close(want.float(), (x.float() @ dense.t()).to(dtype).float(), **TOL[dtype])
    got = q8_0_gemm(x.to(DEVICE), qs.to(DEVICE), d.to(DEVICE))
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


def _q4_k_blocks(n: int, k: int, seed: int):
    """Random llama.cpp Q4_K rows ``[n, k / 256 * 144]``: any nibbles and 6-bit scales and
    mins (every bit pattern of the 12 bytes), small positive fp16 ``d`` and ``dmin`` (weights
    within about +-1.5, as a trained model's: outputs within fp16's absolute tolerance)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = (rng.random((n, k // 256, 1)) * 0.001 + 0.0005).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = (rng.random((n, k // 256, 1)) * 0.002).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize(("n", "k"), [(48, 256), (80, 512)])
def test_q4_k_gemm_matches_the_gguf_library_dequantization(dtype, m, n, k):
    from gguf import GGMLQuantizationType, quants

    from conveyor.kernels.gguf_blocks import split_q4_k
    from conveyor.kernels.quant_gemm import q4_k_gemm

    raw = _q4_k_blocks(n, k, seed=n + k)
    dense = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K).astype("float32"))
    parts = split_q4_k(torch.from_numpy(raw))
    # The reference's unpacking of the scales and nibbles is the library's, bit for bit.
    assert torch.equal(ref.q4_k_weight(*parts), dense)
    x = (0.25 * torch.randn(m, k, generator=torch.Generator().manual_seed(5))).to(dtype)
    want = ref.q4_k_gemm(x, *parts)
    got = q4_k_gemm(x.to(DEVICE), *(p.to(DEVICE) for p in parts))
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
