"""Verification of proposed tokens against the target's logits, keeping its distribution exact.

A request with proposals ``d_1..d_k`` was computed at ``k + 1`` positions in one target pass;
position ``j`` holds the target's logits after ``d_1..d_j``. Each position's logits are
processed exactly as the sampler would process them for that request had it generated
``d_1..d_j`` itself (logit bias, ``min_tokens``, penalties over the longer output), then:

- greedy: accept ``d_j`` while it is the target's argmax, then emit the target's argmax;
- sampling: the proposals are a point mass (prompt lookup, or a draft decoding greedily),
  so the standard rejection rule ``accept with min(1, p/q)`` is ``accept with p(d_j)``; on
  the first rejection the token is drawn from the residual ``max(0, p - q)`` normalised,
  which is ``p`` with ``d_j`` removed; when all ``k`` are accepted, a bonus token is drawn
  from the last position's ``p``. Each emitted token is then distributed exactly as ``p``.

Seeded requests draw every random number from their own generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from conveyor.engine.core.request import Request
from conveyor.engine.sample.sampler import probabilities

if TYPE_CHECKING:
    from conveyor.engine.sample.sampler import Sampler
    from conveyor.engine.sampling_params import SamplingParams


@dataclass
class Verdict:
    token_ids: list[int]  # the accepted proposals, then the target's own token
    num_accepted: int
    logprobs: list[dict[int, float] | None] | None  # one per token, when the request asked
    num_rejected: int = 0  # the proposals computed and rejected (set by ``Speculator.verify``)


def accepts(p_token: float, u: float) -> bool:
    """The rejection rule for a point-mass proposal: accept with probability ``p(token)``."""
    return u < p_token


class _PositionView:
    """A request as the sampler sees it at one verified position: its tokens followed by the
    proposals before that position. Only what ``Sampler.process`` reads."""

    __slots__ = (
        "bias_tensors",
        "generator",
        "grammar",
        "output_token_ids",
        "params",
        "stop_ids",
        "suppress_ids",
        "token_ids",
    )

    def __init__(self, req: Request, proposed: list[int]) -> None:
        self.params: SamplingParams = req.params
        self.token_ids = req.token_ids + proposed if proposed else req.token_ids
        self.output_token_ids = req.output_token_ids + proposed if proposed else req.output_token_ids
        self.stop_ids = req.stop_ids
        self.bias_tensors = req.bias_tensors
        self.suppress_ids = req.suppress_ids
        self.grammar = None  # requests with a grammar are not speculated
        self.generator = req.generator

    @property
    def below_min_tokens(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens


def verify(sampler: Sampler, logits: torch.Tensor, reqs: list[Request]) -> list[Verdict]:
    """One ``Verdict`` per request of ``reqs`` (each with ``spec_token_ids`` set); ``logits``
    holds their ``len(spec_token_ids) + 1`` rows each, request after request."""
    logits = logits.float()
    dev = logits.device
    views: list[_PositionView] = []
    starts: list[int] = []
    for req in reqs:
        starts.append(len(views))
        views.extend(_PositionView(req, req.spec_token_ids[:j]) for j in range(len(req.spec_token_ids) + 1))
    as_reqs = cast("list[Request]", views)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in reqs) else None
    processed = sampler.process(logits, as_reqs)
    argmax = processed.argmax(dim=-1).tolist()
    sampling = [i for i, r in enumerate(reqs) if not r.params.greedy]
    probs = probabilities(processed, [v.params for v in views]) if sampling else None

    results: list[tuple[list[int], int]] = []
    final_rows: list[int] = []  # (sampling requests) the row the last token is drawn from
    rejected: list[int] = []  # ... and the proposal removed from it (-1: none, a bonus token)
    p_proposed: list[float] = []
    if probs is not None:
        rows = [starts[i] + j for i in sampling for j in range(len(reqs[i].spec_token_ids))]
        ids = [t for i in sampling for t in reqs[i].spec_token_ids]
        p_proposed = probs[torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)].tolist()
    uniforms = _uniforms(sampler, [reqs[i] for i in sampling], dev)
    offset = 0
    for i, req in enumerate(reqs):
        proposed, row, k = req.spec_token_ids, starts[i], len(req.spec_token_ids)
        a = 0
        if req.params.greedy:
            while a < k and argmax[row + a] == proposed[a]:
                a += 1
            results.append(([*proposed[:a], argmax[row + a]], a))
            continue
        u = uniforms[req.seq_id]
        while a < k and accepts(p_proposed[offset + a], u[a]):
            a += 1
        offset += k
        final_rows.append(row + a)
        rejected.append(proposed[a] if a < k else -1)
        results.append((proposed[:a], a))  # the drawn token is appended below
    if probs is not None:
        drawn = _draw(sampler, probs, final_rows, rejected, [reqs[i] for i in sampling])
        for i, token in zip(sampling, drawn, strict=True):
            results[i][0].append(token)

    verdicts = []
    for i, (req, (tokens, a)) in enumerate(zip(reqs, results, strict=True)):
        lp = None
        if raw_logprobs is not None and req.params.logprobs is not None:
            rows_t = torch.arange(starts[i], starts[i] + len(tokens), device=dev)
            lp = sampler.logprobs(
                raw_logprobs[rows_t], as_reqs[starts[i] : starts[i] + len(tokens)], torch.tensor(tokens, device=dev)
            )
        verdicts.append(Verdict(tokens, a, lp))
    return verdicts


def _uniforms(sampler: Sampler, reqs: list[Request], dev: torch.device) -> dict[str, list[float]]:
    """One uniform draw per proposal of each request: from its own generator when seeded."""
    out: dict[str, list[float]] = {}
    unseeded = [r for r in reqs if r.generator is None]
    total = sum(len(r.spec_token_ids) for r in unseeded)
    shared = torch.rand(total, generator=sampler.generator, device=dev).tolist() if total else []
    pos = 0
    for r in reqs:
        k = len(r.spec_token_ids)
        if r.generator is None:
            out[r.seq_id] = shared[pos : pos + k]
            pos += k
        else:
            out[r.seq_id] = torch.rand(k, generator=r.generator, device=dev).tolist()
    return out


def _draw(
    sampler: Sampler, probs: torch.Tensor, rows: list[int], rejected: list[int], reqs: list[Request]
) -> list[int]:
    """A token from each row's distribution, without its rejected proposal (the residual,
    unnormalised: the exponential race needs no normalisation)."""
    dev = probs.device
    dist = probs[torch.tensor(rows, device=dev)].clone()
    hit = [j for j, t in enumerate(rejected) if t >= 0]
    if hit:
        removed = torch.tensor([rejected[j] for j in hit], device=dev)
        hit_t = torch.tensor(hit, device=dev)
        p_removed = dist[hit_t, removed]
        dist[hit_t, removed] = 0.0
        # Rejecting a token of probability 1 cannot happen but for rounding: keep it then.
        empty = dist[hit_t].sum(dim=-1) <= 0
        dist[hit_t, removed] = torch.where(empty, p_removed, dist[hit_t, removed])
    noise = torch.empty_like(dist)
    noise.exponential_(generator=sampler.generator)
    for j, r in enumerate(reqs):
        if r.generator is not None:
            noise[j].exponential_(generator=r.generator)
    return (dist / noise).argmax(dim=-1).tolist()
