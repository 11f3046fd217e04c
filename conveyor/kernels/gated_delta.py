"""Pure-torch references of a hybrid model's linear-attention layer (Qwen3.5's gated DeltaNet):
the causal depthwise conv1d with its carried state, and the gated delta rule in recurrent and
chunked form. They are the CPU path and the test oracle; ``conveyor.kernels.reference`` re-exports them.

Layouts, per sequence (the engine loops over prefill chunks and batches decodes):
- conv: ``x [T, C]`` new inputs, ``weight [C, K]``, ``state [C, K - 1]`` the last ``K - 1``
  inputs before ``x`` (zeros at a sequence's start). Output ``silu(conv(x))`` ``[T, C]``.
- delta rule: ``q, k [T, H, dk]`` (already L2-normalised and, for ``q``, scaled by
  ``dk**-0.5``), ``v [T, H, dv]``, ``g [T, H]`` the log decay (<= 0), ``beta [T, H]``, ``state
  [H, dk, dv]``. Per token: ``S = exp(g) S``; ``S += k (beta (v - k^T S))^T``; ``o = q^T S``.
  Everything runs in float32 (as transformers does); the new state is returned in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The chunk length of the chunked form (transformers' and the FLA library's).
DELTA_CHUNK = 64


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu`` of the causal depthwise convolution of ``x`` continuing after ``state``; the
    output ``[T, C]`` (in ``x``'s dtype) and the new state (the last ``K - 1`` inputs)."""
    k = weight.shape[1]
    window = torch.cat((state.to(weight.dtype), x.t().to(weight.dtype)), dim=-1)  # [C, K - 1 + T]
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).t().to(x.dtype), window[:, window.shape[1] - (k - 1) :]


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: ``x [B, C]``, ``states [B, C, K - 1]``; outputs ``[B, C]``
    and the new states."""
    window = torch.cat((states.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)), dim=-1)  # [B, C, K]
    out = F.conv1d(window, weight.unsqueeze(1), groups=weight.shape[0])[:, :, 0]
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA library's and transformers')."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. Leading batch dims are allowed: ``q [..., T, H, dk]``, ``state [..., H,
    dk, dv]``. Returns the outputs ``[..., T, H, dv]`` (float32) and the final state."""
    s = state.float()
    outs = []
    for t in range(q.shape[-3]):
        s = s * g[..., t, :].float().exp()[..., None, None]
        k_t = k[..., t, :, :].float()
        remembered = (s * k_t.unsqueeze(-1)).sum(dim=-2)  # k^T S: [..., H, dv]
        delta = (v[..., t, :, :].float() - remembered) * beta[..., t, :].float().unsqueeze(-1)
        s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((s * q[..., t, :, :].float().unsqueeze(-1)).sum(dim=-2))
    return torch.stack(outs, dim=-3), s


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = DELTA_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result, ``chunk`` tokens at a time (one sequence: ``q [T, H, dk]``). Inside a
    chunk the delta rule's updates are one triangular solve (the WY form: ``(I + A) U = beta V``
    with ``A`` the strictly lower decayed ``beta k k^T``); across chunks the state is carried."""
    length = q.shape[0]
    pad = (-length) % chunk
    # [H, T, d] in float32, padded to whole chunks (padding: zero keys, no decay, no update)
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().t(), (0, pad)) for x in (g, beta))
    heads = q.shape[0]
    n = q.shape[1] // chunk
    q, k, v = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, n, chunk), beta.reshape(heads, n, chunk)
    cum = g.cumsum(dim=-1)  # log decay from the chunk's start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit diagonal after the solve's convention
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    s = state.float()
    out = torch.empty_like(v)
    for c in range(n):
        new_v = u[:, c] - w[:, c] @ s  # what the old state does not already predict
        out[:, c] = q_decayed[:, c] @ s + scores[:, c] @ new_v
        s = s * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ new_v
    out = out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1)
    return out, s


# ---- over a batch, the states in slots (the signatures ``conveyor.kernels.gated_delta_triton`` shares) ----
# ``q, k [T, Hk, dk]`` (each key head serves ``Hv / Hk`` value heads), ``v [T, Hv, dv]``, ``g, beta
# [T, Hv]``, ``states [num_slots, Hv, dk, dv]`` float32, updated in place at ``slots [B]``; a
# sequence with ``fresh [B]`` true starts from a zero state. Outputs go into ``out [T, Hv, dv]``.
#
# Snapshots (speculative decoding's rollback, ``conveyor.engine.memory.state_cache``): with ``snapshots
# [num_slots, S, ...]`` and ``positions [B]`` (each sequence's first row's position), a sequence
# of at most ``1 + S`` rows (a verification) also leaves the state after each of its first
# ``min(rows, S)`` rows, the one after position ``p`` in ``snapshots[slot, p % S]``.


def takes_snapshots(rows: int, num_snapshots: int) -> bool:
    """Whether a sequence of ``rows`` rows leaves per-row snapshots (a verification's length)."""
    return num_snapshots > 0 and rows <= num_snapshots + 1


def causal_conv1d_snapshots(
    x: torch.Tensor, state: torch.Tensor, snapshots: torch.Tensor, slot: int, position: int
) -> None:
    """The conv states after each of ``x``'s first rows (``x [T, C]`` continuing after ``state
    [C, K - 1]``) into ``snapshots [num_slots, S, C, K - 1]``, as the rule above says."""
    num_snapshots, width = snapshots.shape[1], state.shape[1]
    if not takes_snapshots(x.shape[0], num_snapshots):
        return
    count = min(x.shape[0], num_snapshots)
    window = torch.cat((state, x.t().to(state.dtype)), dim=-1)  # [C, K - 1 + T]
    after = window.unfold(1, width, 1)[:, 1 : count + 1].transpose(0, 1)  # [count, C, K - 1]: after each row
    snapshots[slot, [(position + t) % num_snapshots for t in range(count)]] = after


def _delta_snapshots(q, k, v, g, beta, state, snapshots, slot: int, position: int) -> None:
    """The recurrent states after each of a sequence's first rows, as the rule above says."""
    num_snapshots = snapshots.shape[1]
    if not takes_snapshots(q.shape[0], num_snapshots):
        return
    s = state.float()
    for t in range(min(q.shape[0], num_snapshots)):
        rows = slice(t, t + 1)
        _, s = gated_delta_rule_recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows], s)
        snapshots[slot, (position + t) % num_snapshots] = s


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
    """One token per sequence (``T == B``): the recurrent form, batched."""
    rep = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    keep = (~fresh.bool()).view(-1, 1, 1, 1)
    o, s = gated_delta_rule_recurrent(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1), states[slots] * keep
    )
    states[slots] = s
    out.copy_(o[:, 0])


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
    """Sequences of any length, sequence ``b`` on rows ``seq_starts[b]:seq_starts[b + 1]``: the
    chunked form, one sequence at a time (and the snapshots, with ``snapshots``)."""
    rep = v.shape[1] // k.shape[1]
    bounds = seq_starts.tolist()
    starts = positions.tolist() if positions is not None else [0] * len(slots)
    for b, (slot, is_fresh) in enumerate(zip(slots.tolist(), fresh.tolist(), strict=True)):
        rows = slice(bounds[b], bounds[b + 1])
        state = torch.zeros_like(states[slot]) if is_fresh else states[slot]
        qb, kb = q[rows].repeat_interleave(rep, dim=1), k[rows].repeat_interleave(rep, dim=1)
        if snapshots is not None:
            _delta_snapshots(qb, kb, v[rows], g[rows], beta[rows], state, snapshots, slot, starts[b])
        o, states[slot] = gated_delta_rule_chunked(qb, kb, v[rows], g[rows], beta[rows], state)
        out[rows] = o


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor
) -> torch.Tensor:
    """One new input per sequence, ``x [B, C]``, the conv states in slots (``states [num_slots, C,
    K - 1]``, updated in place at ``slots``; ``fresh``: from zeros). Returns ``[B, C]``."""
    keep = (~fresh.bool()).view(-1, 1, 1)
    out, states[slots] = causal_conv1d_decode(x, weight, torch.where(keep, states[slots], 0))
    return out
