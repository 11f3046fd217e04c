"""Batched sampling with per-request parameters and per-request seeds.

Sampling uses the exponential race (argmax of ``p / E`` with ``E ~ Exp(1)``), which draws
exactly from ``p``; each seeded request draws its noise from its own generator, so its tokens
do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.core.request import Request
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured.structured_outputs import StructuredOutputManager


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None  # per row, for rows that asked


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.structured: StructuredOutputManager | None = None  # set by the engine

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        logits = logits.float()
        params = [r.params for r in reqs]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.process(logits, reqs)
        tokens = logits.argmax(dim=-1) if all(p.greedy for p in params) else self._sample(logits, reqs)
        token_list = tokens.tolist()
        logprobs = self.logprobs(raw_logprobs, reqs, tokens) if raw_logprobs is not None else None
        return SamplerOutput(token_list, logprobs)

    def process(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The logits each request samples from: ``logit_bias``, ``min_tokens``' hold on stop
        ids, penalties and grammar masks applied (speculative decoding's verifier shares it)."""
        params = [r.params for r in reqs]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        held = [i for i, r in enumerate(reqs) if r.params.min_tokens and r.below_min_tokens and r.stop_ids]
        if biased or held:
            logits = self._bias_and_hold(logits, reqs, biased, held)
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, reqs)
        if self.structured is not None and any(r.grammar is not None for r in reqs):
            logits = self.structured.apply_masks(logits, reqs)
        return logits

    # ---------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        params = [r.params for r in reqs]
        dev = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        greedy_tokens = logits.argmax(dim=-1)
        probs = probabilities(logits, params)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None and not params[i].greedy:
                noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)

    def _bias_and_hold(
        self, logits: torch.Tensor, reqs: list[Request], biased: list[int], held: list[int]
    ) -> torch.Tensor:
        """``logit_bias`` added, and the stop ids of rows under ``min_tokens`` set to -inf:
        one scatter each over the rows concerned, from tensors each request keeps."""
        logits = logits.clone()  # the caller's logits may be the model's own output
        dev, vocab = logits.device, logits.shape[1]
        if biased:
            ids, values, counts = [], [], []
            for i in biased:
                req = reqs[i]
                if req.bias_tensors is None:
                    bias = req.params.logit_bias or {}
                    req.bias_tensors = (
                        torch.tensor(list(bias), dtype=torch.long, device=dev),
                        torch.tensor(list(bias.values()), dtype=logits.dtype, device=dev),
                    )
                ids.append(req.bias_tensors[0])
                values.append(req.bias_tensors[1])
                counts.append(len(req.bias_tensors[0]))
            rows = _rows(biased, counts, dev)
            logits.index_put_((rows, torch.cat(ids)), torch.cat(values), accumulate=True)
        if held:
            ids, counts = [], []
            for i in held:
                req = reqs[i]
                if req.suppress_ids is None:  # ids past the logits (a stop id no token has) need no mask
                    req.suppress_ids = torch.tensor(
                        sorted(t for t in req.stop_ids if t < vocab), dtype=torch.long, device=dev
                    )
                ids.append(req.suppress_ids)
                counts.append(len(req.suppress_ids))
            rows = _rows(held, counts, dev)
            logits.index_put_((rows, torch.cat(ids)), torch.tensor(float("-inf"), device=dev))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        vocab = logits.shape[1]
        out_counts = torch.zeros(len(rows), vocab, device=logits.device)
        seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=logits.device)
        for j, i in enumerate(rows):
            req = reqs[i]
            if req.output_token_ids:
                ids = torch.tensor(req.output_token_ids, device=logits.device)
                out_counts[j].index_add_(0, ids, torch.ones(len(ids), device=logits.device))
            seen[j, torch.tensor(req.token_ids, device=logits.device)] = True
        p = [reqs[i].params for i in rows]
        rep = torch.tensor([x.repetition_penalty for x in p], device=logits.device).unsqueeze(1)
        freq = torch.tensor([x.frequency_penalty for x in p], device=logits.device).unsqueeze(1)
        pres = torch.tensor([x.presence_penalty for x in p], device=logits.device).unsqueeze(1)
        sub = logits[rows]
        # Repetition penalty as transformers applies it, over prompt and output tokens.
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        # Frequency and presence penalties as the OpenAI API defines them, over output tokens.
        sub = sub - freq * out_counts - pres * (out_counts > 0).float()
        logits = logits.clone()
        logits[rows] = sub
        return logits

    def logprobs(self, raw: torch.Tensor, reqs: list[Request], tokens: torch.Tensor) -> list[dict[int, float] | None]:
        """Each row's logprobs entry from ``raw`` (log-softmax of the unprocessed logits): the
        chosen token's and the request's top ``logprobs``; None for a request that asked for none.
        Speculative decoding's verifier asks it for the tokens it accepts."""
        k_max = max((r.params.logprobs or 0) for r in reqs)
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_ids: list[list[int]] = []
        top_vals: list[list[float]] = []
        if k_max:
            top = raw.topk(k_max, dim=-1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        token_list = tokens.tolist()
        out: list[dict[int, float] | None] = []
        for i, r in enumerate(reqs):
            k = r.params.logprobs
            if k is None:
                out.append(None)
                continue
            entry = {token_list[i]: chosen[i]}
            if k:
                for t, v in zip(top_ids[i][:k], top_vals[i][:k], strict=True):
                    entry.setdefault(t, v)
            out.append(entry)
        return out


def _rows(rows: list[int], counts: list[int], dev: torch.device) -> torch.Tensor:
    """Each row index repeated by its count (the output size given: no device sync)."""
    return torch.tensor(rows, device=dev).repeat_interleave(torch.tensor(counts, device=dev), output_size=sum(counts))


def _top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
    dev = logits.device
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([p.top_k if p.top_k_active else vocab for p in params], device=dev)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    remove = ranks >= ks.unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution: temperature (1 for greedy rows), top-k, top-p, min-p."""
    dev = logits.device
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
    logits = logits / temps.unsqueeze(1)
    if any(p.top_k_active or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
