"""The fused MoE Triton kernel (and its device-side alignment) vs kernels.reference.fused_moe."""

from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.utils import cdiv

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
    from kernels.fused_moe import fused_moe

    got = fused_moe(x, w13, w2, weights, ids, tiles=tiles)
    want = ref.fused_moe(*(t.cpu() for t in (x, w13, w2, weights, ids)))
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[x.dtype])
    return got


def _small_tiles(block_m: int = 16):
    from kernels.fused_moe import MoETiles

    return MoETiles(block_m=block_m, block_n=16, block_k=16, num_warps=1, num_stages=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("tokens", [1, 7, 37])  # 37 * k: not a multiple of BLOCK_M
def test_matches_reference(dtype, k, tokens):
    _check(*_case(tokens, k, dtype, seed=tokens + k), tiles=_small_tiles())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_default_tiles(dtype):
    """The tiles ``choose_tiles`` picks (64-wide), over a batch large enough for BLOCK_M 64."""
    from kernels.fused_moe import choose_tiles

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
    from kernels.fused_moe import fused_moe

    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, tiles=_small_tiles()), got)


def test_all_tokens_on_one_expert():
    tokens = 21
    x, w13, w2, weights, ids = _case(tokens, 1, torch.float32, ids=torch.full((tokens, 1), 3))
    weights = torch.ones_like(weights)
    got = _check(x, w13, w2, weights, ids, tiles=_small_tiles())
    gate, up = (x @ w13[3].T).chunk(2, dim=-1)
    torch.testing.assert_close(got, (torch.nn.functional.silu(gate) * up) @ w2[3].T, **TOL[torch.float32])


def test_zero_tokens():
    from kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _case(0, 2, torch.float32)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, HIDDEN)


def test_alignment_pads_each_expert_to_block_m():
    from kernels.fused_moe import align_assignments

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
    from kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _case(3, 2, torch.float32)
    with pytest.raises(ValueError, match=r"w2 \(6, 40, 48\) should be \[6, 48, 40\]"):
        fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
