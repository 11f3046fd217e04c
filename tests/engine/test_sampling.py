"""Sampling: per-request seeds, filters, penalties, stops, logprobs, detokenization."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from conveyor.engine import RequestOutput, SamplingParams
from conveyor.engine.core.request import Request
from conveyor.engine.sample.sampler import Sampler
from tests.engine.reference import assert_greedy_match

PROMPT = "Seven guests wait at the table and the waiter"
OTHERS = [
    "The chef will bring",
    "Tea",
    "Warm bread and fresh fish",
    "Count to ten: one two three",
    "Late guests ask the waiter about the menu",
    "A",
    "Serve",
    "queue worker engine cache block",
]


def test_seeded_request_is_the_same_alone_and_in_a_busy_batch(tiny_models, make_llm):
    path = tiny_models("llama")
    p = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = make_llm(path).generate([PROMPT], p)[0].token_ids

    busy_llm = make_llm(path, max_num_seqs=6, max_num_batched_tokens=24)
    prompts, params = [], []
    for i, other in enumerate(OTHERS):
        prompts.append(other)
        params.append(SamplingParams(max_tokens=10 + 7 * i, temperature=1.0, seed=i if i % 2 else None))
        if i == 3:
            prompts.append(PROMPT)
            params.append(p)
    busy = busy_llm.generate(prompts, params)[4].token_ids
    assert alone == busy
    assert len(set(alone)) > 10  # really sampled, not a constant


def test_seeds_differ_and_n_samples_use_consecutive_seeds(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    base: dict[str, Any] = dict(max_tokens=20, temperature=1.0, ignore_eos=True)
    a = llm.generate([PROMPT], SamplingParams(seed=7, **base))[0].token_ids
    b = llm.generate([PROMPT], SamplingParams(seed=8, **base))[0].token_ids
    assert a != b
    both = llm.generate([PROMPT], SamplingParams(seed=7, n=2, **base))
    assert [o.index for o in both] == [0, 1]
    assert both[0].token_ids == a and both[1].token_ids == b


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"seed": -1}, "seed"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": "8"}, "max_tokens"),
    ],
)
def test_bad_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _rows(n: int, **params) -> list[Request]:
    return [
        Request(
            str(i), [1, 2, 3], SamplingParams(**params), max_total_tokens=100, eos_token_ids=frozenset(), arrival_seq=i
        )
        for i in range(n)
    ]


def test_top_k_top_p_min_p_sample_only_allowed_tokens_in_proportion():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 2
    probs = logits.softmax(-1)[0]
    order = probs.argsort(descending=True).tolist()
    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = 4000
    # top_k=5
    got = sampler(logits.expand(rows, -1), _rows(rows, temperature=1.0, top_k=5)).token_ids
    assert set(got) <= set(order[:5])
    kept = probs[order[:5]] / probs[order[:5]].sum()
    for rank, tok in enumerate(order[:5]):
        freq = got.count(tok) / rows
        assert abs(freq - kept[rank].item()) < 4 * math.sqrt(kept[rank].item() / rows) + 1e-3
    # top_p: the smallest set of top tokens reaching p
    cum = probs[order].cumsum(0)
    n_keep = int((cum < 0.6).sum()) + 1
    got = sampler(logits.expand(rows, -1), _rows(rows, temperature=1.0, top_p=0.6)).token_ids
    assert set(got) <= set(order[:n_keep]) and len(set(got)) == n_keep
    # min_p: tokens under min_p * max probability never come out
    got = sampler(logits.expand(rows, -1), _rows(rows, temperature=1.0, min_p=0.3)).token_ids
    allowed = {t for t in range(50) if probs[t] >= 0.3 * probs.max()}
    assert set(got) <= allowed


def test_penalties_follow_their_definitions():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    rows = _rows(2, temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    for r, out in zip(rows, ([4, 4, 7], [9]), strict=True):
        for t in out:
            r.append_token(t)
    got = Sampler(torch.device("cpu"), 0)._apply_penalties(logits, rows)
    expected = logits.clone()
    for i, r in enumerate(rows):
        for t in set(r.token_ids):  # repetition: prompt and output
            x = expected[i, t]
            expected[i, t] = x / 1.5 if x > 0 else x * 1.5
        for t in set(r.output_token_ids):  # presence/frequency: output only
            expected[i, t] -= 0.5 + 0.25 * r.output_token_ids.count(t)
    torch.testing.assert_close(got, expected)


def test_repetition_penalty_matches_transformers(tiny_models, hf_reference, make_llm):
    path = tiny_models("qwen2")
    hf = hf_reference(path)
    llm = make_llm(path)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3))[0]
    assert_greedy_match(out.token_ids, hf.greedy(hf.encode(PROMPT), 30, repetition_penalty=1.3), "rep")


@pytest.mark.parametrize("filt", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_degenerate_filters_equal_greedy(filt, tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=25, temperature=0))[0].token_ids
    sampled = llm.generate([PROMPT], SamplingParams(max_tokens=25, temperature=1.0, **filt))[0].token_ids
    assert sampled == greedy


def test_stop_strings_cut_the_text_and_deltas_add_up(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    tok = llm.get_tokenizer()
    full = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[12:15]
    cut = full.text.find(stop)
    engine = llm.engine
    engine.add_request(
        "s", PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "never-there"])
    )
    deltas: list[str] = []
    last: RequestOutput | None = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.new_text)
            last = o
    assert last is not None
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert last.text == full.text[:cut]
    assert "".join(deltas) == last.text
    assert last.token_ids == full.token_ids[: len(last.token_ids)]


def test_stop_token_ids_and_eos_and_ignore_eos(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    full = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
    t = full[5]
    first = full.index(t)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[t]))[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop" and out.stop_reason == t
    llm.engine.eos_token_ids = frozenset({t})  # pretend this token is EOS
    assert llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0))[0].token_ids == full[: first + 1]
    kept = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert kept.token_ids == full and kept.finish_reason == "length"


def test_logprobs_of_chosen_and_top_tokens_match_transformers(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    hf = hf_reference(path)
    llm = make_llm(path)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, logprobs=3))[0]
    ref = hf.greedy(hf.encode(PROMPT), 12)
    assert_greedy_match(out.token_ids, ref)
    assert len(out.logprobs) == len(out.token_ids)
    for tok, entry, logits in zip(out.token_ids, out.logprobs, ref.logits, strict=True):
        lp = torch.log_softmax(logits, -1)
        top = lp.topk(3)
        assert set(entry) == {tok} | set(top.indices.tolist())
        for t, v in entry.items():
            assert v == pytest.approx(lp[t].item(), abs=1e-4)
