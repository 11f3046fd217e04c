"""Triton kernels of the gated delta rule (Qwen3.5's linear attention) over a batch whose states
live in slots: the decode update (one token per sequence) and the chunked prefill form. Same
signatures and numerics (float32 throughout) as ``conveyor.kernels.gated_delta``'s ``gated_delta_decode``
and ``gated_delta_prefill``, their references.

Each program owns one (sequence, value head, ``BV`` columns of the state): the state tile ``[dk,
BV]`` stays in registers from its load to its store, read from and written back to the sequence's
slot in place (so the step needs no gather or scatter of states, and reads no host data).

The prefill walks its sequence ``BT`` tokens at a time. Inside a chunk the delta rule's updates
are one unit lower-triangular system ``(I + A) X = R`` (the WY form, as in the reference), solved
by forward substitution, row by row: stable where keys are alike and ``A`` is far from zero (the
series ``(I - A)(I + A^2)(I + A^4)...``, all matrix products, is exact in theory but loses every
digit there). The other products run on ``tl.dot`` in IEEE float32, as the reference computes.

With snapshots (speculative decoding's rollback; the rule is ``conveyor.kernels.gated_delta``'s), a
sequence of at most ``1 + NSNAP`` rows (one chunk) also stores the state after each of its first
rows: ``exp(cum_i) S + sum over j <= i of exp(cum_i - cum_j) k_j x_j^T``, the chunk's end-of-chunk
update stopped at row ``i``, from the same solved ``x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import cdiv, next_pow2

# Tokens per chunk of the prefill kernel, state columns per program, and the key dim's block.
# The chunk is not the reference's 64 (the result does not depend on it): 32 keeps the [BT, BT]
# system, its unrolled solve and the tiles in registers, without spills, at Qwen3.5's dk = 128.
PREFILL_CHUNK = 32
PREFILL_BV = 32
PREFILL_BK = 32
PREFILL_WARPS = 8
DECODE_BV = 32


@triton.jit
def _delta_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slot_ptr,
    fresh_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    REP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    s_mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    s = tl.where(tl.load(fresh_ptr + b) != 0, 0.0, s)
    hk = h // REP
    q = tl.load(q_ptr + b * stride_qt + hk * stride_qh + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kt + hk * stride_kh + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vt + h * stride_vh + offs_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gt + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_bt + h).to(tl.float32)
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_v, o.to(out_ptr.dtype.element_ty), mask=mv)
    tl.store(s_ptrs, s, mask=s_mask)


@triton.jit
def _delta_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slot_ptr,
    fresh_ptr,
    seq_start_ptr,
    out_ptr,
    snap_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_ps,
    REP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    NSNAP: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // REP
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    offs_t = tl.arange(0, BT)
    mv = offs_v < DV
    start = tl.load(seq_start_ptr + n)
    end = tl.load(seq_start_ptr + n + 1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    s_base = state_ptr + slot * stride_ss + h * stride_sh
    # 0: the state starts at zero, what its slot holds is ignored (until the first chunk writes it)
    carried = (tl.load(fresh_ptr + n) == 0).to(tl.int32)
    # Snapshots (a verification's length, so its only chunk), ``snap_base`` the slot's first.
    snap_rows = tl.where(end - start <= NSNAP + 1, end - start, 0)
    snap_base = snap_ptr + slot * stride_ps + h * stride_sh
    causal = offs_t[:, None] >= offs_t[None, :]
    strict = offs_t[:, None] > offs_t[None, :]
    for c0 in range(start, end, BT):
        rows = (c0 + offs_t).to(tl.int64)
        mt = rows < end
        # Rows past the sequence's end: zero keys, values, beta and decay, so they change nothing.
        g = tl.load(g_ptr + rows * stride_gt + h, mask=mt, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_bt + h, mask=mt, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, 0)  # log decay from the chunk's start to each row
        total = tl.sum(g, 0)
        # decay[i, j] = exp(cum_i - cum_j) for j <= i (never overflows: cum only falls)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        v_mask = mt[:, None] & mv[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :], mask=v_mask, other=0.0)
        kk = tl.zeros((BT, BT), dtype=tl.float32)
        qk = tl.zeros((BT, BT), dtype=tl.float32)
        predicted = tl.zeros((BT, BV), dtype=tl.float32)  # k_beta decayed, times the state
        o = tl.zeros((BT, BV), dtype=tl.float32)
        # The key dim in blocks of BK, the state's rows read from its slot block by block (whole
        # [dk, BV] tiles as dot operands need more registers than there are).
        for kb in tl.static_range(0, DK, BK):
            offs_k = kb + tl.arange(0, BK)
            mk = offs_k < DK
            qk_mask = mt[:, None] & mk[None, :]
            k = tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + offs_k[None, :], mask=qk_mask, other=0.0)
            q = tl.load(q_ptr + rows[:, None] * stride_qt + hk * stride_qh + offs_k[None, :], mask=qk_mask, other=0.0)
            k, q = k.to(tl.float32), q.to(tl.float32)
            s = tl.load(s_base + offs_k[:, None] * DV + offs_v[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
            s = tl.where(carried != 0, s, 0.0)
            k_beta = k * beta[:, None]
            kk += tl.dot(k_beta, tl.trans(k), input_precision="ieee")
            qk += tl.dot(q, tl.trans(k), input_precision="ieee")
            predicted += tl.dot(k_beta * tl.exp(cum)[:, None], s, input_precision="ieee")
            o += tl.dot(q * tl.exp(cum)[:, None], s, input_precision="ieee")
        neg_a = tl.where(strict, -kk * decay, 0.0)  # -A
        # Right-hand side: what the state before the chunk does not already predict.
        x = v.to(tl.float32) * beta[:, None] - predicted
        # Forward substitution, row by row: x_i -= sum over j < i of A_ij x_j. Unrolled: a loop
        # over i spills registers (selecting row i is a runtime compare in every thread then).
        for i in tl.static_range(1, BT):
            a_i = tl.sum(tl.where(offs_t[:, None] == i, neg_a, 0.0), 0)  # row i of -A, by column
            x_i = tl.sum(tl.where(offs_t[:, None] == i, x, 0.0), 0) + tl.sum(a_i[:, None] * x, 0)
            x = tl.where(offs_t[:, None] == i, x_i[None, :], x)
        o += tl.dot(qk * decay, x, input_precision="ieee")
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=v_mask)  # fmt: skip
        for kb in tl.static_range(0, DK, BK):
            offs_k = kb + tl.arange(0, BK)
            mk = offs_k < DK
            k = tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + offs_k[None, :],
                        mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)  # fmt: skip
            s_ptrs = s_base + offs_k[:, None] * DV + offs_v[None, :]
            s = tl.where(carried != 0, tl.load(s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0), 0.0)
            if NSNAP > 0:  # noqa: SIM102 (a constexpr test: the code is not compiled without snapshots)
                if snap_rows > 0:
                    pos = tl.load(pos_ptr + n).to(tl.int64)
                    for i in tl.static_range(NSNAP):
                        if i < snap_rows:
                            cum_i = tl.sum(tl.where(offs_t == i, cum, 0.0), 0)
                            k_to_i = k * tl.where(offs_t <= i, tl.exp(cum_i - cum), 0.0)[:, None]
                            snap = s * tl.exp(cum_i) + tl.dot(tl.trans(k_to_i), x, input_precision="ieee")
                            snap_ptrs = (
                                snap_base + ((pos + i) % NSNAP) * stride_ss + offs_k[:, None] * DV + offs_v[None, :]
                            )
                            tl.store(snap_ptrs, snap, mask=mk[:, None] & mv[None, :])
            k_to_end = k * tl.exp(total - cum)[:, None]
            s = s * tl.exp(total) + tl.dot(tl.trans(k_to_end), x, input_precision="ieee")
            tl.store(s_ptrs, s, mask=mk[:, None] & mv[None, :])
        carried = carried | 1
        # The next chunk's threads read state elements other threads of this program wrote.
        tl.debug_barrier()
    # A fresh sequence with no rows leaves its slot as it was (the model never asks that).


@triton.jit
def _conv_update_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    slot_ptr,
    fresh_ptr,
    out_ptr,
    stride_x,
    stride_o,
    stride_ss,
    channels,
    K: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_j = tl.arange(0, BK)  # tap j of the window: state[:, j] for j < K - 1, then x
    mc = offs_c < channels
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + offs_c[:, None] * (K - 1) + offs_j[None, :]
    s_mask = mc[:, None] & (offs_j[None, :] < K - 1)
    window = tl.load(s_ptrs, mask=s_mask, other=0.0)
    window = tl.where(tl.load(fresh_ptr + b) != 0, 0.0, window)
    x = tl.load(x_ptr + b * stride_x + offs_c, mask=mc, other=0.0)
    window = tl.where(offs_j[None, :] == K - 1, x[:, None], window)  # [BC, BK]: the K inputs
    w = tl.load(w_ptr + offs_c[:, None] * K + offs_j[None, :], mask=mc[:, None] & (offs_j[None, :] < K), other=0.0)
    # In the weight's dtype, as the reference's conv (then SiLU in float32, rounded once).
    acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), 1).to(w_ptr.dtype.element_ty).to(tl.float32)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * stride_o + offs_c, out.to(out_ptr.dtype.element_ty), mask=mc)
    # The new state: the window shifted by one (taps 1..K-1), read back from the slot's old
    # values and x. Each thread stores what it loaded, shifted through a second load.
    shifted = tl.load(s_ptrs + 1, mask=mc[:, None] & (offs_j[None, :] < K - 2), other=0.0)
    shifted = tl.where(tl.load(fresh_ptr + b) != 0, 0.0, shifted)
    shifted = tl.where(offs_j[None, :] == K - 2, x[:, None], shifted)
    tl.debug_barrier()  # every thread has read the old state before any writes the new one
    tl.store(s_ptrs, shifted.to(state_ptr.dtype.element_ty), mask=s_mask)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor
) -> torch.Tensor:
    """One new input per sequence; see ``conveyor.kernels.gated_delta.causal_conv1d_update``."""
    batch, channels = x.shape
    k = weight.shape[1]
    assert weight.shape == (channels, k) and states.shape[1:] == (channels, k - 1) and states.is_contiguous()
    assert x.stride(-1) == 1 and slots.shape == fresh.shape == (batch,)
    out = torch.empty_like(x)
    if batch:
        block = min(256, next_pow2(channels))
        _conv_update_kernel[(batch, cdiv(channels, block))](
            x, weight.contiguous(), states, slots, fresh.to(torch.int8), out,
            x.stride(0), out.stride(0), states.stride(0), channels,
            K=k, BK=next_pow2(k), BC=block, num_warps=4,
        )  # fmt: skip
    return out


def _check(q, k, v, g, beta, states, slots, fresh, out) -> tuple[int, int, int]:
    tokens, k_heads, dk = k.shape
    v_heads, dv = v.shape[1], v.shape[2]
    assert q.shape == k.shape and v.shape[0] == tokens and v_heads % k_heads == 0
    assert g.shape == beta.shape == (tokens, v_heads) and out.shape == v.shape
    assert states.dtype == torch.float32 and states.shape[1:] == (v_heads, dk, dv) and states.is_contiguous()
    assert slots.shape == fresh.shape and slots.dim() == 1
    for t in (q, k, v, out):
        assert t.stride(-1) == 1
    return v_heads // k_heads, dk, dv


def _strides(q, k, v, g, beta, states, out) -> tuple[int, ...]:
    return (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), states.stride(0), states.stride(1),
    )  # fmt: skip


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One token per sequence; see ``conveyor.kernels.gated_delta.gated_delta_decode``."""
    rep, dk, dv = _check(q, k, v, g, beta, states, slots, fresh, out)
    batch = slots.shape[0]
    assert q.shape[0] == batch
    if not batch:
        return
    bv = min(DECODE_BV, next_pow2(dv))
    _delta_decode_kernel[(batch, v.shape[1], cdiv(dv, bv))](
        q, k, v, g, beta, states, slots, fresh.to(torch.int8), out,
        *_strides(q, k, v, g, beta, states, out),
        REP=rep, DK=dk, DV=dv, BK=max(16, next_pow2(dk)), BV=bv, num_warps=4,
    )  # fmt: skip


def gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    seq_starts: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    out: torch.Tensor,
    snapshots: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Sequences of any length in one launch; see ``conveyor.kernels.gated_delta.gated_delta_prefill``."""
    rep, dk, dv = _check(q, k, v, g, beta, states, slots, fresh, out)
    num_seqs = slots.shape[0]
    assert seq_starts.shape == (num_seqs + 1,)
    if not num_seqs:
        return
    num_snapshots = 0
    if snapshots is not None:
        num_snapshots = snapshots.shape[1]
        assert positions is not None and positions.shape == (num_seqs,)
        assert (
            snapshots.shape[2:] == states.shape[1:] and snapshots.is_contiguous() and snapshots.dtype == torch.float32
        )
        assert num_snapshots + 1 <= PREFILL_CHUNK  # a verification fits one chunk
    bv = min(PREFILL_BV, max(16, next_pow2(dv)))
    _delta_prefill_kernel[(num_seqs, v.shape[1], cdiv(dv, bv))](
        q, k, v, g, beta, states, slots, fresh.to(torch.int8), seq_starts, out,
        snapshots if snapshots is not None else states, positions if positions is not None else slots,
        *_strides(q, k, v, g, beta, states, out), snapshots.stride(0) if snapshots is not None else 0,
        REP=rep, DK=dk, DV=dv, BK=min(PREFILL_BK, max(16, next_pow2(dk))), BV=bv, BT=PREFILL_CHUNK,
        NSNAP=num_snapshots, num_warps=PREFILL_WARPS,
    )  # fmt: skip
