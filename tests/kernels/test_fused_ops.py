"""Triton RMSNorm (+ fused residual add) and SiLU-and-mul vs conveyor.kernels.reference."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import reference as ref

from ._helpers import DEVICE, DTYPES, Tol

TOL: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=1e-5, rtol=1e-5),
    torch.float16: Tol(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tol(atol=2e-2, rtol=2e-2),
}


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(dtype, hidden, with_residual):
    from conveyor.kernels.triton_ops import rms_norm

    x = 3 * _rand(2, 3, hidden, dtype=dtype, seed=1)
    w = _rand(hidden, dtype=dtype, seed=2)
    res = _rand(2, 3, hidden, dtype=dtype, seed=3) if with_residual else None
    got = rms_norm(x, w, 1e-6, residual=res)
    want = ref.rms_norm(x.cpu(), w.cpu(), 1e-6, residual=None if res is None else res.cpu())
    if with_residual:
        torch.testing.assert_close(got[1].cpu(), want[1], atol=0, rtol=0)  # exact add
        got, want = got[0], want[0]
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


def test_rms_norm_strided_rows():
    from conveyor.kernels.triton_ops import rms_norm

    big = _rand(5, 128, dtype=torch.float32, seed=4)
    x = big[:, :64]  # row stride 128
    w = _rand(64, dtype=torch.float32, seed=5)
    torch.testing.assert_close(rms_norm(x, w, 1e-5).cpu(), ref.rms_norm(x.cpu(), w.cpu(), 1e-5), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("d", [64, 80])
def test_silu_and_mul(dtype, d):
    from conveyor.kernels.triton_ops import silu_and_mul

    x = 4 * _rand(3, 2, 2 * d, dtype=dtype, seed=d)
    got = silu_and_mul(x)
    assert got.shape == (3, 2, d) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), ref.silu_and_mul(x.cpu()), **TOL[dtype])
