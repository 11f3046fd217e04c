"""The Triton W4A16 GEMM (int4 groups dequantized in its K loop) vs kernels.reference, and its
compilation for sm_90 and sm_80 without register spills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import reference as ref

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
    from kernels.quant_gemm import w4a16_gemm

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
    assert {(r["arch"], r["dtype"], r["config"][0]) for r in results} >= {
        (arch, dt, bm) for arch in (80, 90) for dt in ("bf16", "fp16") for bm in (16, 64)
    }
    for r in results:
        assert r["shared"] <= 100 * 1024, r
        if r["spill"] is not None:
            assert r["spill"] == 0, f"register spills: {r}"
