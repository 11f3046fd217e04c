"""The kernel-shape cases: each Triton kernel written since the first GPU run, at a released
model's shapes (a dry run: the same code at tiny shapes), with its float32 reference on the
same (upcast) inputs and, where the reference also runs in the kernel's dtype, that run.

Shapes come from the families' published configs: Qwen3.5-9B's linear attention (16 key and
32 value heads of 128, conv kernel 4; ``tests/engine/test_qwen3_5.py``), Qwen3.5-35B-A3B's
experts (256, top 8, 512 wide, hidden 2048), gpt-oss-20b (32 experts top 4, hidden and
intermediate 2880; 64 query and 8 KV heads of 64, window 128, sinks), DeepSeek-V2-Lite's MLA
(16 heads, kv_lora_rank 512, rope 64), Qwen3-8B (hidden 4096, intermediate 12288, FP8 blocks
of 128x128) and Llama-3.1-8B (hidden 4096, intermediate 14336, 32/8 heads of 128)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.kernels import gated_delta as gd_ref
from conveyor.kernels import reference as ref
from conveyor.kernels.gated_delta import l2_normalise
from conveyor.kernels.utils import cdiv


@dataclass(frozen=True)
class Prepared:
    """One case ready to run: ``ours()`` is timed; the references are computed once."""

    ours: Callable[[], torch.Tensor]
    ref32: torch.Tensor  # float32 arithmetic on the inputs the kernel gets, upcast
    ref_native: torch.Tensor | None  # the reference in the kernel's dtype, where it has one


@dataclass(frozen=True)
class Case:
    name: str
    kernel: str
    shape: str  # the released model and the sizes, in words
    dtype: torch.dtype
    build: Callable[[torch.device], Prepared]


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def _randn(shape: tuple[int, ...], g: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device)


def _f32(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() if t.is_floating_point() else t for t in ts]


# ---- gated delta rule (Qwen3.5's linear attention) ----------------------------------------
def _delta_inputs(tokens, kh, vh, dk, dv, dtype, device, seed):
    g = _gen(device, seed)
    q = (l2_normalise(_randn((tokens, kh, dk), g, device)) * dk**-0.5).to(dtype)
    k = l2_normalise(_randn((tokens, kh, dk), g, device)).to(dtype)
    v = _randn((tokens, vh, dv), g, device).to(dtype)
    decay = -torch.rand(tokens, vh, generator=g, device=device) * 1.5  # float32, as the model's
    beta = torch.rand(tokens, vh, generator=g, device=device).to(dtype)
    return q, k, v, decay, beta


def delta_prefill(lengths, kh, vh, dk, dv, dtype, snapshots: int = 0) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels import gated_delta_triton as tri

        n = len(lengths)
        tensors = _delta_inputs(sum(lengths), kh, vh, dk, dv, dtype, device, seed=1)
        states = _randn((n + 2, vh, dk, dv), _gen(device, 2), device) * 0.1
        slots = torch.arange(n, device=device) + 1
        fresh = torch.tensor([i % 2 == 0 for i in range(n)], device=device)
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        snaps = torch.zeros(n + 2, snapshots, vh, dk, dv, device=device) if snapshots else None
        positions = torch.arange(n, device=device) * 7 if snapshots else None

        def run(fn, ts, s, snap) -> torch.Tensor:
            out = torch.empty(ts[2].shape, dtype=ts[2].dtype, device=device)
            extra = (snap, positions) if snap is not None else ()
            fn(*ts, s, starts, slots, fresh, out, *extra)
            return out

        def clone(t):
            return None if t is None else t.clone()

        ref32 = run(gd_ref.gated_delta_prefill, _f32(*tensors), states.clone(), clone(snaps))
        native = run(gd_ref.gated_delta_prefill, list(tensors), states.clone(), clone(snaps))
        work = states.clone()
        return Prepared(lambda: run(tri.gated_delta_prefill, list(tensors), work, snaps), ref32, native)

    return build


def delta_decode(batch, kh, vh, dk, dv, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels import gated_delta_triton as tri

        tensors = _delta_inputs(batch, kh, vh, dk, dv, dtype, device, seed=3)
        states = _randn((batch + 1, vh, dk, dv), _gen(device, 4), device) * 0.1
        slots = torch.randperm(batch + 1, generator=_gen(device, 5), device=device)[:batch]
        fresh = torch.zeros(batch, dtype=torch.bool, device=device)

        def run(fn, ts, s) -> torch.Tensor:
            out = torch.empty(ts[2].shape, dtype=ts[2].dtype, device=device)
            fn(*ts, s, slots, fresh, out)
            return out

        ref32 = run(gd_ref.gated_delta_decode, _f32(*tensors), states.clone())
        native = run(gd_ref.gated_delta_decode, list(tensors), states.clone())
        # Each timed call advances the states; the first call, checked, starts from ``states``.
        work = states.clone()
        return Prepared(lambda: run(tri.gated_delta_decode, list(tensors), work), ref32, native)

    return build


def conv_update(batch, channels, taps, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels import gated_delta_triton as tri

        g = _gen(device, 6)
        x = _randn((batch, channels), g, device).to(dtype)
        weight = (_randn((channels, taps), g, device) * 0.5).to(dtype)
        states = _randn((batch + 2, channels, taps - 1), g, device).to(dtype)
        slots = torch.arange(batch, device=device) + 1
        fresh = torch.tensor([i % 3 == 0 for i in range(batch)], device=device)
        # (``.float()`` of a float32 tensor is the tensor itself: each run gets its own states)
        ref32 = gd_ref.causal_conv1d_update(x.float(), weight.float(), states.float().clone(), slots, fresh)
        native = gd_ref.causal_conv1d_update(x, weight, states.clone(), slots, fresh)
        work = states.clone()
        return Prepared(lambda: tri.causal_conv1d_update(x, weight, work, slots, fresh), ref32, native)

    return build


# ---- paged attention: sinks and windows (gpt-oss), FP8 KV with per-head scales ------------
def _paged(reqs, kv_heads, group, head_dim, block, dtype, device, seed):
    """A cache of ``reqs`` ((cached, new) tokens each) in scattered blocks; float32 values."""
    g = _gen(device, seed)
    lens = [c + n for c, n in reqs]
    nblk = [cdiv(n, block) for n in lens]
    total = sum(nblk) + 1
    order = (torch.randperm(total - 1, generator=g, device=device) + 1).tolist()
    tables = torch.zeros(len(reqs), max(nblk), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nblk):
        tables[i, :nb] = torch.tensor(order[used : used + nb])
        used += nb
    k_cache = _randn((total, block, kv_heads, head_dim), g, device)
    v_cache = _randn((total, block, kv_heads, head_dim), g, device)
    q_lens = [n for _, n in reqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = _randn((sum(q_lens), kv_heads * group, head_dim), g, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    meta = (tables.to(device), qsl, seq_lens, head_dim**-0.5, max(q_lens), max(lens))
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta


def attention_sinks(reqs, kv_heads, group, head_dim, window, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels.triton_ops import paged_attention

        q, kc, vc, (tables, qsl, lens, scale, mq, ms) = _paged(reqs, kv_heads, group, head_dim, 16, dtype, device, 7)
        sinks = (_randn((kv_heads * group,), _gen(device, 8), device) * 2).to(dtype)

        def reference(q_, k_, v_, s_):
            return ref.paged_attention(q_, k_, v_, tables, qsl, lens, scale, sliding_window=window, sinks=s_)

        ref32 = reference(*_f32(q, kc, vc, sinks))
        native = reference(q, kc, vc, sinks)
        return Prepared(
            lambda: paged_attention(q, kc, vc, tables, qsl, lens, scale, mq, ms, sliding_window=window, sinks=sinks),
            ref32,
            native,
        )

    return build


def fp8_kv_scaled(reqs, kv_heads, group, head_dim, dtype) -> Callable[[torch.device], Prepared]:
    """A checkpoint's per-head KV scales folded into the queries and output (``conveyor.engine.models.
    kv_scale_fold``) over an e4m3 cache of ``k / k_scale``; the reference attends the real keys."""

    def build(device: torch.device) -> Prepared:
        from conveyor.engine.models.kv_scale_fold import KVScaleFold
        from conveyor.kernels.triton_ops import paged_attention

        q, kc, vc, (tables, qsl, lens, scale, mq, ms) = _paged(reqs, kv_heads, group, head_dim, 16, dtype, device, 9)
        g = _gen(device, 10)
        k_scale = torch.rand(kv_heads, generator=g, device=device) * 0.02 + 0.005  # keys up to ~4 / 448
        v_scale = torch.rand(kv_heads, generator=g, device=device) * 0.02 + 0.005
        fold = KVScaleFold().to(device)
        fold.set(k_scale, v_scale, kv_heads * group, dtype)
        k8 = (kc / fold.k_scale).to(torch.float8_e4m3fn)
        v8 = (vc / fold.v_scale).to(torch.float8_e4m3fn)
        # The reference: the values the cache holds, at their scale, attended in float32.
        k_real = k8.float() * k_scale.view(-1, 1)
        v_real = v8.float() * v_scale.view(-1, 1)
        ref32 = ref.paged_attention(q.float(), k_real, v_real, tables, qsl, lens, scale)
        native = ref.paged_attention(q, k_real.to(dtype), v_real.to(dtype), tables, qsl, lens, scale)

        def ours() -> torch.Tensor:
            q_in = q * fold.q_factor  # (``fold_in``'s query part: the keys are in the cache)
            return fold.fold_out(paged_attention(q_in, k8, v8, tables, qsl, lens, scale, mq, ms))

        return Prepared(ours, ref32, native)

    return build


# ---- MLA decode (DeepSeek-V2-Lite) --------------------------------------------------------
def mla(seq_lens, heads, rank, rope, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels.mla_decode import mla_decode

        g = _gen(device, 11)
        block = 16
        nblk = [cdiv(n, block) for n in seq_lens]
        total = sum(nblk) + 1
        order = (torch.randperm(total - 1, generator=g, device=device) + 1).tolist()
        tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
        used = 0
        for i, nb in enumerate(nblk):
            tables[i, :nb] = torch.tensor(order[used : used + nb])
            used += nb
        tables = tables.to(device)
        cache = _randn((total, block, 1, rank + rope), g, device).to(dtype)
        q = _randn((len(seq_lens), heads, rank + rope), g, device).to(dtype)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        scale = (128 + rope) ** -0.5  # qk_nope_head_dim 128 + rope: the model's softmax scale
        ref32 = ref.mla_decode(q.float(), cache.float(), tables, lens, scale, rank)
        native = ref.mla_decode(q, cache, tables, lens, scale, rank)
        longest = max(seq_lens)
        return Prepared(lambda: mla_decode(q, cache, tables, lens, scale, rank, max_seq_len=longest), ref32, native)

    return build


# ---- fused MoE: bf16 experts (Qwen3.5-35B-A3B) and MXFP4 ones (gpt-oss-20b) ---------------
def _routing(tokens, experts, top_k, device, seed):
    logits = _randn((tokens, experts), _gen(device, seed), device)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def moe_dense(tokens, experts, top_k, hidden, inter, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels.fused_moe import fused_moe

        g = _gen(device, 12)
        x = _randn((tokens, hidden), g, device).to(dtype)
        w13 = (_randn((experts, 2 * inter, hidden), g, device) * hidden**-0.5).to(dtype)
        w2 = (_randn((experts, hidden, inter), g, device) * inter**-0.5).to(dtype)
        weights, ids = _routing(tokens, experts, top_k, device, 13)
        ref32 = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
        native = ref.fused_moe(x, w13, w2, weights, ids)
        return Prepared(lambda: fused_moe(x, w13, w2, weights, ids), ref32, native)

    return build


def moe_mxfp4(tokens, experts, top_k, hidden, inter, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels.fused_moe import fused_moe

        g = _gen(device, 14)

        def weight(rows: int, cols: int, scale_exp: int) -> ref.Mxfp4Weight:
            blocks = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, device=device).to(torch.uint8)
            spread = torch.randint(-1, 2, (experts, rows, cols // 32), generator=g, device=device)
            return ref.Mxfp4Weight(blocks, (127 + scale_exp + spread).to(torch.uint8))

        # Powers of two that keep outputs of order one: e2m1 values up to 6, ~1/sqrt(width).
        w13, w2 = weight(2 * inter, hidden, -8), weight(hidden, inter, -8)
        x = _randn((tokens, hidden), g, device).to(dtype)
        b13 = (_randn((experts, 2 * inter), g, device) * 0.1).to(dtype)
        b2 = (_randn((experts, hidden), g, device) * 0.1).to(dtype)
        act = ref.ClampedSwiGLU(alpha=1.702, limit=7.0)  # gpt-oss's
        weights, ids = _routing(tokens, experts, top_k, device, 15)
        dense13, dense2 = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
        ref32 = ref.fused_moe(x.float(), dense13, dense2, weights, ids, act, b13.float(), b2.float())
        native = ref.fused_moe(x, w13, w2, weights, ids, act, b13, b2)
        return Prepared(lambda: fused_moe(x, w13, w2, weights, ids, activation=act, b13=b13, b2=b2), ref32, native)

    return build


# ---- quantized-weight GEMMs ----------------------------------------------------------------
def _x(m: int, k: int, dtype, device) -> torch.Tensor:
    return (_randn((m, k), _gen(device, 16), device) * 0.25).to(dtype)


def _gemm(x: torch.Tensor, dense: torch.Tensor, ours: Callable[[], torch.Tensor]) -> Prepared:
    """The kernel against ``x @ dense.T`` (``dense``: the float32 weight the format stores)."""
    return Prepared(ours, x.float() @ dense.t(), (x @ dense.to(x.dtype).t()))


def fp8_block(m, n, k, block, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels.quant_gemm import fp8_block_gemm

        g = _gen(device, 17)
        weight = (_randn((n, k), g, device) * 40).to(torch.float8_e4m3fn)
        scale = torch.rand(cdiv(n, block[0]), cdiv(k, block[1]), generator=g, device=device) * 1e-3 + 1e-4
        x = _x(m, k, dtype, device)
        full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        dense = weight.float() * full
        return _gemm(x, dense, lambda: fp8_block_gemm(x, weight, scale, block))

    return build


def w4a16(m, n, k, group, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels.quant_gemm import w4a16_gemm

        g = _gen(device, 18)
        qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g, device=device, dtype=torch.int64)
        qweight = qweight.to(torch.int32)
        scales = (torch.rand(n, k // group, generator=g, device=device) * 0.004 + 0.001).to(dtype)
        zeros = torch.randint(0, 16, (n, k // group), generator=g, device=device).to(torch.uint8)
        x = _x(m, k, dtype, device)
        shifts = torch.arange(0, 32, 4, device=device)
        q = ((qweight.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).reshape(n, k).float()
        dense = (q - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
        return _gemm(x, dense, lambda: w4a16_gemm(x, qweight, scales, zeros, group))

    return build


def q8_0(m, n, k, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels.quant_gemm import q8_0_gemm

        g = _gen(device, 19)
        qs = torch.randint(-127, 128, (n, k), generator=g, device=device).to(torch.int8)
        d = (torch.rand(n, k // 32, generator=g, device=device) * 2e-4 + 1e-4).to(torch.float16)
        x = _x(m, k, dtype, device)
        dense = qs.float() * d.float().repeat_interleave(32, dim=1)
        return _gemm(x, dense, lambda: q8_0_gemm(x, qs, d))

    return build


def q4_k(m, n, k, dtype) -> Callable[[torch.device], Prepared]:
    def build(device: torch.device) -> Prepared:
        from conveyor.kernels.gguf_blocks import split_q4_k
        from conveyor.kernels.quant_gemm import q4_k_gemm

        g = _gen(device, 20)
        raw = torch.randint(0, 256, (n, k // 256, 144), generator=g, device=device).to(torch.uint8)
        raw[..., 0:2] = (
            (torch.rand(n, k // 256, 1, generator=g, device=device) * 4e-4 + 1e-4).to(torch.float16).view(torch.uint8)
        )
        raw[..., 2:4] = (
            (torch.rand(n, k // 256, 1, generator=g, device=device) * 8e-4).to(torch.float16).view(torch.uint8)
        )
        parts = split_q4_k(raw.reshape(n, -1))
        x = _x(m, k, dtype, device)
        return _gemm(x, ref.q4_k_weight(*parts), lambda: q4_k_gemm(x, *parts))

    return build


def w8a8(m, n, k, dtype) -> Callable[[torch.device], Prepared]:
    """Per-token e4m3 inputs, per-channel e4m3 weights: ``torch._scaled_mm`` on sm_90 in bf16,
    the FP8 Triton GEMM elsewhere (and in the interpreter)."""

    def build(device: torch.device) -> Prepared:
        from conveyor.engine.quantization.activations import ActivationQuant
        from conveyor.engine.quantization.kernel_weights import Fp8Weight
        from conveyor.engine.quantization.w8a8 import W8A8Weight

        g = _gen(device, 21)
        weight = (_randn((n, k), g, device) * 40).to(torch.float8_e4m3fn)
        w_scale = torch.rand(n, generator=g, device=device) * 1e-3 + 1e-4
        act = ActivationQuant("token")
        layer = W8A8Weight.of(Fp8Weight.per_row(weight, w_scale), act, None)
        assert layer is not None
        x = _x(m, k, dtype, device)
        # The reference: the input's own e4m3 rounding, then float32 arithmetic.
        scale = act.scale(x, None)
        x_q = act.dequantize(act.quantize(x, scale), scale)
        dense = weight.float() * w_scale.view(-1, 1)
        return Prepared(lambda: layer.matmul(x), x_q @ dense.t(), (x_q.to(dtype) @ dense.to(dtype).t()))

    return build
