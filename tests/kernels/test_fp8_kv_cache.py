"""An FP8 (e4m3, scale 1) KV cache in the Triton kernels, under the interpreter: the KV write
stores the bytes torch's own e4m3 conversion gives, encoded in arithmetic (GPUs before
sm_89, and the interpreter, whose own conversion truncates) or on a GPU through the e4m3
type; paged attention reads them back into the queries' dtype and matches the torch
reference on the same cache read back, with sinks, a window, a soft cap and key splits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conveyor.kernels.reference import paged_attention as ref_paged_attention

from ._helpers import DEVICE, TOL, make_batch

E4M3 = torch.float8_e4m3fn
# (cached tokens, new query tokens) per request: decodes, a prefill, prefills over a cache.
REQUESTS = [(30, 1), (0, 21), (13, 9), (3, 1), (40, 5)]
MODES = pytest.mark.parametrize("arithmetic", [False, True], ids=["e4m3-type", "e4m3-arithmetic"])


def _values(n: int, seed: int) -> torch.Tensor:
    """Values over e4m3's whole range: subnormals (below 2**-6), exact ties between two e4m3
    values, and up to 440."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 9, (n,), generator=g).float())
    every = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    every = every[torch.isfinite(every) & (every.abs() <= 440)]
    ties = (every[:-1] + every[1:]) / 2  # sorted by byte within each sign: neighbours
    return torch.cat([spread.clamp(-440, 440), every, ties[ties.abs() < 440]])


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_kv_write_stores_torchs_e4m3_bytes(arithmetic, dtype):
    from conveyor.kernels.triton_ops import write_kv_cache

    if DEVICE != "cuda" and not arithmetic:
        pytest.skip("the interpreter's own conversion to e4m3 truncates; the GPU's rounds (cvt.rn)")

    heads, head_dim = 2, 16
    values = _values(2000, seed=3).to(dtype)
    tokens = values.numel() // (heads * head_dim)
    k = values[: tokens * heads * head_dim].reshape(tokens, heads, head_dim)
    v = -k.flip(0)
    slots = torch.randperm(tokens + 7, generator=torch.Generator().manual_seed(1))[:tokens]
    k_cache = torch.zeros((tokens + 7, 1, heads, head_dim), dtype=E4M3)
    v_cache = torch.zeros_like(k_cache)
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    write_kv_cache(k.to(DEVICE), v.to(DEVICE), k_dev, v_dev, slots.to(DEVICE), encode_e4m3=arithmetic)
    for cache, x in ((k_dev, k), (v_dev, v)):
        got = cache.cpu().view(torch.uint8)[slots, 0]
        want = x.float().to(E4M3).view(torch.uint8)
        assert torch.equal(got, want)


def test_arithmetic_encoding_saturates_at_448():
    from conveyor.kernels.triton_ops import write_kv_cache

    k = torch.tensor([[[1000.0, -1000.0, 448.0, 460.0, -0.0, 1e-9, 0.0009765625, 0.0]]])
    k_cache = torch.zeros((1, 1, 1, 8), dtype=E4M3, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    write_kv_cache(k.to(DEVICE), k.to(DEVICE), k_cache, v_cache, torch.tensor([0], device=DEVICE), encode_e4m3=True)
    # 448 is e4m3's largest; 2**-10 is half the smallest subnormal (2**-9): a tie, to even 0.
    assert k_cache.cpu().view(torch.uint8).flatten().tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0x80, 0, 0, 0]


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    "window,softcap,sinks,splits",
    [(None, None, False, 1), (None, None, False, 3), (8, 30.0, False, 1), (5, None, True, 2), (None, None, True, 1)],
    ids=["plain", "split3", "window8-softcap", "window5-sinks-split2", "sinks"],
)
def test_paged_attention_reads_an_fp8_cache(arithmetic, dtype, window, softcap, sinks, splits):
    from conveyor.kernels.triton_ops import paged_attention

    batch = make_batch(REQUESTS, num_kv_heads=2, group=2, head_dim=32, block_size=4, dtype=dtype, seed=7).cpu()
    fp8 = dataclasses.replace(batch, k_cache=batch.k_cache.to(E4M3), v_cache=batch.v_cache.to(E4M3))
    # The reference reads the same cache, read back into the queries' dtype.
    read_back = dataclasses.replace(batch, k_cache=fp8.k_cache.to(dtype), v_cache=fp8.v_cache.to(dtype))
    sink = (torch.randn(4, generator=torch.Generator().manual_seed(11)) * 2).to(dtype) if sinks else None
    on_device = dataclasses.replace(
        fp8,
        **{f.name: getattr(fp8, f.name).to(DEVICE) for f in dataclasses.fields(fp8) if f.type == "torch.Tensor"},
    )
    out = paged_attention(
        *on_device.args(),
        num_kv_splits=splits,
        block_m=16,
        tile_n=16,
        sliding_window=window,
        softcap=softcap,
        sinks=sink.to(DEVICE) if sink is not None else None,
        decode_e4m3=arithmetic,
    )
    ref = ref_paged_attention(*read_back.args(), sliding_window=window, softcap=softcap, sinks=sink)
    assert out.dtype == dtype and not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])
