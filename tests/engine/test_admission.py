"""Admission by predicted output length (``admission_policy="predicted"``) against today's
watermark rule: on the scheduler alone (deterministic, no model) and on a tiny model, where
the greedy outputs must be transformers' whichever rule admits."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conveyor.engine import EngineConfig, SamplingParams
from conveyor.engine.core.admission import PredictedAdmission
from conveyor.engine.core.output_length import OUTPUT_LENGTH_MIN_SAMPLES, OutputLengthEstimator
from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.memory.kv_cache import KVCacheManager
from tests.engine.helpers import step_without_model
from tests.engine.reference import Greedy, assert_greedy_match

# ---- the estimator -----------------------------------------------------------------------


def test_survival_is_the_share_of_longer_outputs_among_those_still_running():
    est = OutputLengthEstimator(min_samples=4)
    for n in (2, 4, 4, 8):  # of max_tokens 8: shares 0.25, 0.5, 0.5, 1
        assert not est.ready
        est.record(n, 8)
    assert est.ready
    generated, max_output = np.array([0, 3, 4, 8, 0]), np.array([8, 8, 8, 8, 80])
    got = est.survival(generated, max_output, np.array([0, 1, 4, 8]))
    expected = [
        [1.0, 1.0, 0.25, 0.0],  # from 0 (4 further): past 0, 1, 4 of 8 -> 4, 4, 1; 8 is the maximum
        [1.0, 1 / 3, 1 / 3, 0.0],  # from 3 (3 further): past 3, 4, 7 -> 3, 1, 1; 11 is beyond the maximum
        [1.0, 1.0, 0.0, 0.0],  # from 4 (1 further): past 4, 5 -> 1, 1; 8, 12: at or beyond the maximum
        [0.0, 0.0, 0.0, 0.0],  # at its maximum: done
        [1.0, 1.0, 1.0, 1.0],  # of 80: 8 tokens are a tenth of it, and every sample went further
    ]
    np.testing.assert_allclose(got, expected)
    # Gone further than every sample: assumed to run to its maximum.
    short = OutputLengthEstimator(min_samples=1)
    short.record(1, 10)
    short.record(2, 10)
    assert short.survival(np.array([5]), np.array([10]), np.array([0, 1, 4, 5])).tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_the_estimator_forgets_the_oldest_samples():
    est = OutputLengthEstimator(window=3, min_samples=1)
    for n in (100, 1, 2, 3):
        est.record(n, 100)
    assert est.num_samples == 3
    assert est.num_longer(np.array([0.5])).tolist() == [0]  # the 100 of 100 is gone
    with pytest.raises(ValueError, match="num_output_tokens"):
        est.record(5, 4)


# ---- on the scheduler alone -----------------------------------------------------------------


# The token that stops a request (the workload's stop ids; the other tokens are 7).
STOP = 3


def _stopping_at(stop_at: dict[str, int]):
    """What a request produces next: the stop token at its chosen output length."""
    return lambda req: STOP if len(req.output_token_ids) + 1 >= stop_at[req.request_id] else 7


def _workload(n: int, long_share: float, seed: int = 0) -> tuple[list[Request], dict[str, int]]:
    """``n`` requests with 8-token prompts and max_tokens 64; most stop after 6 tokens, a
    ``long_share`` of them run to 64. Returns them and the output length each stops at."""
    rng = random.Random(seed)
    reqs, stop_at = [], {}
    for i in range(n):
        req = Request(
            f"r{i}",
            [1000 * (i + 1) + j for j in range(8)],
            SamplingParams(max_tokens=64, ignore_eos=True, stop_token_ids=[STOP]),
            max_total_tokens=100_000,
            eos_token_ids=frozenset(),
            arrival_seq=i,
        )
        stop_at[req.request_id] = 64 if rng.random() < long_share else 6
        reqs.append(req)
    return reqs, stop_at


def _sched(admission: str, num_blocks: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_caching=False)
    return Scheduler(kv, max_num_seqs=64, max_num_batched_tokens=256, admission=admission)


def _run(sched: Scheduler, reqs: list[Request], stop_at: dict[str, int]) -> list[list[tuple[str, int]]]:
    """Step to the end as the engine does (a token per finished prefill, the stop reported to
    the scheduler); returns every step's (request, tokens) plan."""
    for r in reqs:
        sched.add_request(r)
    plans = []
    while sched.has_unfinished():
        out, _ = step_without_model(sched, _stopping_at(stop_at))
        plans.append([(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens, strict=True)])
        assert len(plans) < 5000
    assert sched.kv.num_used_blocks == 0
    return plans


@pytest.mark.parametrize(("num_blocks", "long_share"), [(64, 0.25), (128, 0.25), (128, 0.5)])
def test_predicted_admission_preempts_less_when_most_requests_stop_early(num_blocks, long_share):
    results = {}
    for admission in ("watermark", "predicted"):
        reqs, stop_at = _workload(128, long_share)
        sched = _sched(admission, num_blocks)
        plans = _run(sched, reqs, stop_at)
        assert all(len(r.output_token_ids) == stop_at[r.request_id] for r in reqs)
        results[admission] = (sched.num_preemptions, len(plans))
    (wm_preempt, _), (pred_preempt, _) = results["watermark"], results["predicted"]
    assert wm_preempt > 0, "the workload must be one where the watermark rule preempts"
    assert pred_preempt < wm_preempt / 2, results


def test_predicted_admission_changes_nothing_when_the_cache_is_large_enough():
    plans = {}
    for admission in ("watermark", "predicted"):
        reqs, stop_at = _workload(128, 0.25)
        sched = _sched(admission, 2048)
        plans[admission] = _run(sched, reqs, stop_at)
        assert sched.num_preemptions == 0
    assert plans["predicted"] == plans["watermark"]


def test_until_enough_requests_finished_the_watermark_rule_alone_decides():
    """Step by step the same plans as the watermark rule while fewer than the minimum of
    samples are in; the prediction only starts to hold requests back after that."""
    reqs_w, stop_at = _workload(128, 0.5)
    reqs_p, _ = _workload(128, 0.5)
    watermark, predicted = _sched("watermark", 64), _sched("predicted", 64)
    admission = predicted.admission
    assert isinstance(admission, PredictedAdmission)
    for sched, reqs in ((watermark, reqs_w), (predicted, reqs_p)):
        for r in reqs:
            sched.add_request(r)
    plans_w = _run_steps(watermark, stop_at, until=lambda: admission.estimator.ready, other=predicted)
    assert admission.estimator.num_samples == OUTPUT_LENGTH_MIN_SAMPLES
    assert admission.num_held_back == 0 and watermark.num_preemptions > 0  # the watermark preempted in warm-up
    assert plans_w[0] == plans_w[1]
    _run(predicted, [], stop_at)
    assert admission.num_held_back > 0


def _run_steps(a: Scheduler, stop_at: dict[str, int], *, until, other: Scheduler) -> tuple[list, list]:
    """Step ``a`` and ``other`` together until ``until()``; their plans."""
    plans: tuple[list, list] = ([], [])
    while not until():
        for sched, plan in zip((a, other), plans, strict=True):
            out, _ = step_without_model(sched, _stopping_at(stop_at))
            plan.append([(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens, strict=True)])
        assert len(plans[0]) < 1000
    return plans


def test_unknown_admission_policies_raise():
    with pytest.raises(ValueError, match=r"unknown admission policy 'oracle'.*'watermark', 'predicted'"):
        _sched("oracle", 8)
    with pytest.raises(ValueError, match="admission_policy must be one of"):
        EngineConfig("m", admission_policy="oracle")


# ---- on a tiny model ------------------------------------------------------------------------

NUM_PROMPTS = 32
MAX_TOKENS = 32


@torch.no_grad()
def _batched_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[Greedy]:
    """Transformers' greedy continuations of equal-length prompts, in one batch, never stopping
    (as ``ignore_eos``): its forward pass over the whole sequence at each step."""
    ids = torch.tensor(prompts)
    margins = []
    for _ in range(max_new_tokens):
        logits = hf.model(ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
        top2 = logits.topk(2).values
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    start = len(prompts[0])
    return [Greedy(ids[i, start:].tolist(), [m[i] for m in margins], []) for i in range(len(prompts))]


def test_same_greedy_outputs_and_fewer_preemptions_on_a_tiny_model(tiny_models, hf_reference, make_llm):
    """Three requests in four stop after a few tokens (a stop token id taken from their own
    greedy continuation), the fourth runs to ``max_tokens``; a cache of a few long ones."""
    path = tiny_models("llama")
    hf = hf_reference(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(8)] for _ in range(NUM_PROMPTS)]
    refs = _batched_greedy(hf, prompts, MAX_TOKENS)
    params, expected = [], []
    for i, ref in enumerate(refs):
        c = ref.token_ids
        stop = next((k for k in range(3, 10) if c[k] not in c[:k]), None) if i % 4 != 3 else None
        stop_ids = [c[stop]] if stop is not None else None
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=stop_ids))
        end = MAX_TOKENS if stop is None else stop + 1
        expected.append(Greedy(c[:end], ref.margins[:end], []))
    assert sum(p.stop_token_ids is not None for p in params) >= NUM_PROMPTS // 2
    preemptions = {}
    for admission in ("watermark", "predicted"):
        llm = make_llm(path, block_size=4, num_kv_blocks=40, max_num_seqs=16, admission_policy=admission)
        outs = llm.generate(prompts, params)
        for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
            assert_greedy_match(out.token_ids, ref, label=f"{admission} prompt {i}")
        preemptions[admission] = llm.engine.stats().num_preemptions
    assert preemptions["watermark"] > 0
    assert preemptions["predicted"] < preemptions["watermark"], preemptions
