"""The fused MoE Triton kernel (and its device-side alignment) vs conveyor.kernels.reference.fused_moe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.kernels import reference as ref
from conveyor.kernels.utils import cdiv

from ._helpers import DEVICE, DTYPES, Tol

TOL: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=1e-4, rtol=1e-4),
    torch.float16: Tol(atol=2e-2, rtol=2e-2),
    torch.bfloat16: Tol(atol=5e-2, rtol=5e-2),
}

EXPERTS, HIDDEN, INTER = 6, 48, 40  # neither a multiple of the 16/32-wide tiles below


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _case(tokens: int, k: int, dtype: torch.dtype, seed: int = 0, ids: torch.Tensor | None = None) -> Case:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2
    if ids is None:
        logits = torch.randn(tokens, EXPERTS, generator=g)
        weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    else:
        weights = torch.rand(tokens, k, generator=g)
    x, w13, w2, weights, ids = (t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids))
    return x, w13, w2, weights, ids


def _check(x, w13, w2, weights, ids, tiles=None) -> torch.Tensor:
    from conveyor.kernels.fused_moe import fused_moe

    got = fused_moe(x, w13, w2, weights, ids, tiles=tiles)
    want = ref.fused_moe(*(t.cpu() for t in (x, w13, w2, weights, ids)))
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[x.dtype])
    return got


def _small_tiles(block_m: int = 16):
    from conveyor.kernels.fused_moe import MoETiles

    return MoETiles(block_m=block_m, block_n=16, block_k=16, num_warps=1, num_stages=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 37])  # 37 * k: not a multiple of BLOCK_M
def test_matches_reference(dtype, k, tokens):
    _check(*_case(tokens, k, dtype, seed=tokens + k), tiles=_small_tiles())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_default_tiles(dtype):
    """The tiles ``choose_tiles`` picks (64-wide), over a batch large enough for BLOCK_M 64."""
    from conveyor.kernels.fused_moe import choose_tiles

    assert choose_tiles(70, 2, EXPERTS).block_m == 64
    _check(*_case(70, 2, dtype, seed=3))


@pytest.mark.parametrize("k", [1, 2])
def test_experts_with_no_tokens(k):
    """Only experts 1 and 4 get tokens; 0 (first), 5 (last), 2 and 3 get none."""
    tokens = 19
    ids = torch.tensor([[1, 4][(t + j) % 2] for t in range(tokens) for j in range(k)]).view(tokens, k)
    x, w13, w2, weights, ids = _case(tokens, k, torch.float32, ids=ids)
    got = _check(x, w13, w2, weights, ids, tiles=_small_tiles())
    # An unused expert's weights are never read: NaN there changes nothing.
    w13[0] = float("nan")
    w2[5] = float("nan")
    from conveyor.kernels.fused_moe import fused_moe

    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, tiles=_small_tiles()), got)


def test_all_tokens_on_one_expert():
    tokens = 21
    x, w13, w2, weights, ids = _case(tokens, 1, torch.float32, ids=torch.full((tokens, 1), 3))
    weights = torch.ones_like(weights)
    got = _check(x, w13, w2, weights, ids, tiles=_small_tiles())
    gate, up = (x @ w13[3].T).chunk(2, dim=-1)
    torch.testing.assert_close(got, (torch.nn.functional.silu(gate) * up) @ w2[3].T, **TOL[torch.float32])


def test_zero_tokens():
    from conveyor.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _case(0, 2, torch.float32)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, HIDDEN)


def test_alignment_pads_each_expert_to_block_m():
    from conveyor.kernels.fused_moe import align_assignments

    ids = torch.tensor([[2, 0], [2, 5], [0, 2]])  # expert 0: 2, expert 2: 3, expert 5: 1
    block_m = 4
    a = align_assignments(ids.to(DEVICE), EXPERTS, block_m)
    n = ids.numel()
    assert a.sorted_ids.numel() == cdiv(n + EXPERTS * (block_m - 1), block_m) * block_m
    sorted_ids, block_expert = a.sorted_ids.cpu().tolist(), a.block_expert.cpu().tolist()
    # Stable by expert, each run padded with the sentinel n to a block of its own.
    assert sorted_ids[:12] == [1, 4, n, n, 0, 2, 5, n, 3, n, n, n]
    assert all(r == n for r in sorted_ids[12:])
    assert block_expert[:3] == [0, 2, 5] and all(e == -1 for e in block_expert[3:])


def test_bad_shapes_are_named():
    from conveyor.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _case(3, 2, torch.float32)
    with pytest.raises(ValueError, match=r"w2 \(6, 40, 48\) should be \[6, 48, 40\]"):
        fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, weights[:, :1], ids)


def _gpt_oss_case(tokens: int, k: int, dtype: torch.dtype, seed: int = 0):
    """gpt-oss's experts: interleaved gate/up, biases, weights in transformers' ``[experts, in,
    out]`` layout (the kernel reads them through transposed views, never copied)."""
    g = torch.Generator().manual_seed(seed)
    x, _, _, weights, ids = _case(tokens, k, dtype, seed=seed)
    gate_up = (torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=g) * 0.3).to(dtype).to(DEVICE)
    down = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) * 0.2).to(dtype).to(DEVICE)
    b13 = (torch.randn(EXPERTS, 2 * INTER, generator=g) * 0.5).to(dtype).to(DEVICE)
    b2 = (torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5).to(dtype).to(DEVICE)
    return x, gate_up.transpose(1, 2), down.transpose(1, 2), weights, ids, b13, b2


# A limit the tests' projections cross (gpt-oss's own is 7), so both clamps bite.
SWIGLU = ref.ClampedSwiGLU(alpha=1.702, limit=1.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_clamped_swiglu_with_biases_matches_reference(dtype):
    from conveyor.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids, b13, b2 = _gpt_oss_case(13, 2, dtype, seed=5)
    gate_up = x.float() @ w13[ids[0, 0]].float().T + b13[ids[0, 0]].float()
    assert (gate_up[:, ::2] > SWIGLU.limit).any() and (gate_up[:, 1::2].abs() > SWIGLU.limit).any()
    got = fused_moe(x, w13, w2, weights, ids, tiles=_small_tiles(), activation=SWIGLU, b13=b13, b2=b2)
    cpu = [t.cpu() for t in (x, w13, w2, weights, ids)]
    want = ref.fused_moe(cpu[0], cpu[1], cpu[2], cpu[3], cpu[4], activation=SWIGLU, b13=b13.cpu(), b2=b2.cpu())
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    # The oracle computes what transformers' gpt-oss experts do, one token at a time.
    for t in range(x.shape[0]):
        row = torch.zeros(HIDDEN, dtype=dtype)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = SWIGLU(cpu[0][t] @ cpu[1][e].T + b13[e].cpu()) @ cpu[2][e].T + b2[e].cpu()
            row += (h * cpu[3][t, j]).to(dtype)
        torch.testing.assert_close(want[t], row, **TOL[dtype])


def _mxfp4(w: torch.Tensor) -> ref.Mxfp4Weight:
    """``w [experts, rows, cols]`` packed as gpt-oss ships its experts (the tests' packer)."""
    from tests.engine.quantized_checkpoints import mxfp4_pack

    blocks, scales = mxfp4_pack(w.transpose(1, 2))  # (it takes transformers' [experts, in, out])
    return ref.Mxfp4Weight(blocks.flatten(-2).to(DEVICE), scales.to(DEVICE))


def test_mxfp4_reference_is_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(EXPERTS, 2 * INTER, 64, generator=torch.Generator().manual_seed(1))
    packed = _mxfp4(w)
    blocks = packed.blocks.cpu().unflatten(-1, (-1, 16))
    theirs = convert_moe_packed_tensors(blocks, packed.scales.cpu(), dtype=torch.float32)  # [experts, in, out]
    assert torch.equal(packed.dequantize().cpu(), theirs.transpose(1, 2))
    assert packed.blocks.element_size() * packed.blocks.numel() + packed.scales.numel() == w.numel() * 17 // 32


# Steps of one group of 32, and of two groups (64, past the end of hidden 96).
@pytest.mark.parametrize(("dtype", "block_k"), [(torch.float32, 32), (torch.float16, 64)], ids=["f32-32", "f16-64"])
def test_mxfp4_weights_dequantized_in_the_k_loop(dtype, block_k):
    from conveyor.kernels.fused_moe import MoETiles, fused_moe

    hidden, inter = 96, 32  # whole groups of 32 inputs
    g = torch.Generator().manual_seed(block_k)
    x = torch.randn(5, hidden, generator=g).to(dtype).to(DEVICE)
    w13 = _mxfp4(torch.randn(EXPERTS, 2 * inter, hidden, generator=g) * 0.1)
    w2 = _mxfp4(torch.randn(EXPERTS, hidden, inter, generator=g) * 0.1)
    b13 = torch.randn(EXPERTS, 2 * inter, generator=g).to(dtype).to(DEVICE)
    b2 = torch.randn(EXPERTS, hidden, generator=g).to(dtype).to(DEVICE)
    weights, ids = torch.topk(torch.randn(5, EXPERTS, generator=g).softmax(-1), 2, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    tiles = MoETiles(block_m=16, block_n=32, block_k=block_k, num_warps=1, num_stages=1)
    got = fused_moe(x, w13, w2, weights, ids, tiles=tiles, activation=SWIGLU, b13=b13, b2=b2)
    dense13, dense2 = w13.dequantize(dtype), w2.dequantize(dtype)
    want = ref.fused_moe(x, dense13, dense2, weights, ids, activation=SWIGLU, b13=b13, b2=b2)
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL[dtype])


def test_mxfp4_steps_shorter_than_two_dots_of_16_are_refused():
    """A 16-deep step would split into two 8-deep dots, which Triton 3.6 refuses to compile
    (the first H200 run); the engine's tiles never ask for it, and a caller's are refused."""
    from conveyor.kernels.fused_moe import MoETiles, fused_moe

    x = torch.randn(3, 64).to(DEVICE)
    w13, w2 = _mxfp4(torch.randn(EXPERTS, 64, 64) * 0.1), _mxfp4(torch.randn(EXPERTS, 64, 32) * 0.1)
    weights, ids = torch.topk(torch.randn(3, EXPERTS).softmax(-1), 2, dim=-1)
    tiles = MoETiles(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=1)
    with pytest.raises(ValueError, match="MXFP4 weights need block_k >= 32, got 16"):
        fused_moe(x, w13, w2, weights.to(DEVICE), ids.to(DEVICE), tiles=tiles)


def test_gpt_oss_variants_compile_for_gpu_without_spills():
    """The clamped-SwiGLU and MXFP4 variants, compiled ahead of time for sm_90 and sm_80 in a
    subprocess (``_gpu_compile_gpt_oss_moe.py``; the SiLU ones are in ``test_gpu_compile``)."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not available")
    script = Path(__file__).resolve().parent / "_gpu_compile_gpt_oss_moe.py"
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["kernel"], r["variant"], r["arch"], r["config"][0]) for r in results} == {
        (f"fused_moe/{k}", v, arch, bm)
        for k in ("gate_up", "down")
        for v in ("gpt_oss", "gpt_oss_mxfp4")
        for arch in (90, 80)
        for bm in (16, 64)
    }
    for r in results:
        assert r["shared"] <= 100 * 1024, r
        if r["spill"] is not None:
            assert r["spill"] == 0, f"register spills: {r}"
