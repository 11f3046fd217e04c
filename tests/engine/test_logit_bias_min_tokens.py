"""logit_bias and min_tokens, judged against transformers' generate with the same logits
processing (a bias-adding LogitsProcessor; min_new_tokens with the stop ids as EOS)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conveyor.engine import SamplingParams
from conveyor.engine.core.request import Request
from conveyor.engine.sample.sampler import Sampler
from tests.engine.reference import Greedy, HFReference, assert_greedy_match

PROMPT = "Seven guests wait at the table and the waiter"
OTHER = "Warm bread and fresh fish"


class AddBias(LogitsProcessor):
    """OpenAI's logit_bias as a transformers logits processor: the bias added to the scores."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        biased = scores.clone()
        for token, value in self.bias.items():
            biased[:, token] += value
        return biased  # type: ignore[return-value]  # (transformers annotates FloatTensor)


@torch.no_grad()
def hf_greedy(hf: HFReference, prompt: str, max_new_tokens: int, **kwargs: Any) -> Greedy:
    """transformers' greedy tokens and the top-two margins of the scores it compared."""
    ids = torch.tensor([hf.encode(prompt)])
    out = hf.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=hf.tokenizer.pad_token_id,
        **kwargs,
    )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return Greedy(tokens, margins, [])


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


# ---- logit_bias -----------------------------------------------------------------------------


def test_logit_bias_greedy_equals_transformers_with_the_same_bias(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    hf = hf_reference(path)
    llm = make_llm(path)
    plain = llm.generate([PROMPT], greedy(30, ignore_eos=True))[0].token_ids
    # Push down what greedy picked, pull up a few others: the output must change.
    bias = {plain[0]: -5.0, plain[1]: -2.5, plain[3]: 1.5, 17: 4.0, 42: 3.0, 101: -1.0}
    out = llm.generate([PROMPT], greedy(30, logit_bias=bias))[0]
    ref = hf_greedy(hf, PROMPT, 30, logits_processor=LogitsProcessorList([AddBias(bias)]))
    assert out.token_ids != plain[: len(out.token_ids)]
    assert_greedy_match(out.token_ids, ref, "logit_bias")


def test_minus_100_bans_and_plus_100_forces(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    plain = llm.generate([PROMPT], greedy(20, ignore_eos=True))[0].token_ids
    banned = plain[0]
    out = llm.generate([PROMPT], greedy(20, ignore_eos=True, logit_bias={banned: -100}))[0].token_ids
    assert banned not in out and out[0] != plain[0]
    sampled = llm.generate(
        [PROMPT], SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True, logit_bias={banned: -100})
    )[0].token_ids
    assert banned not in sampled
    forced = next(t for t in range(50, 500) if t not in plain)
    for params in (
        greedy(10, ignore_eos=True, logit_bias={forced: 100}),
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, logit_bias={forced: 100}),
    ):
        assert llm.generate([PROMPT], params)[0].token_ids == [forced] * 10


def test_biased_rows_do_not_leak_into_the_rest_of_the_batch(tiny_models, make_llm):
    llm = make_llm(tiny_models("qwen2"))
    prompts = [PROMPT, OTHER, PROMPT, OTHER]
    plain = [o.token_ids for o in llm.generate(prompts, greedy(16, ignore_eos=True))]
    params = [
        greedy(16, ignore_eos=True, logit_bias={plain[0][0]: -100, 7: 2.0}),
        greedy(16, ignore_eos=True),
        greedy(16, ignore_eos=True, logit_bias={plain[2][1]: -100}),
        greedy(16, ignore_eos=True, min_tokens=3),
    ]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert batched == alone
    assert batched[1] == plain[1] and batched[3] == plain[3]
    assert batched[0] != plain[0] and batched[2] != plain[2]


def test_sampler_adds_the_bias_and_masks_stop_ids_only_on_their_rows():
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=0, logit_bias={3: 2.5, 39: -100}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5, 6, 999]),  # 999: past the logits
    ]
    reqs = [
        Request(str(i), [1], p, max_total_tokens=100, eos_token_ids=frozenset({7}), arrival_seq=i)
        for i, p in enumerate(params)
    ]
    sampler = Sampler(torch.device("cpu"), 0)
    got = sampler._bias_and_hold(logits, reqs, [0], [2])
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 39] -= 100
    expected[2, [5, 6, 7]] = float("-inf")
    torch.testing.assert_close(got, expected)
    assert torch.isfinite(logits).all()  # the input is left alone
    reqs[2].append_token(1)
    reqs[2].append_token(2)  # min_tokens reached: nothing masked any more
    assert not reqs[2].below_min_tokens
    assert sampler(logits[1:], reqs[1:]).token_ids == logits[1:].argmax(-1).tolist()


# ---- min_tokens -----------------------------------------------------------------------------


def test_min_tokens_holds_stop_ids_and_eos_like_transformers_min_new_tokens(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    hf = hf_reference(path)
    llm = make_llm(path)
    plain = llm.generate([PROMPT], greedy(40, ignore_eos=True))[0].token_ids
    # The greedy next token and another frequent one stop generation: EOS-heavy.
    stops = sorted({plain[0], max(set(plain), key=plain.count)})
    early = llm.generate([PROMPT], greedy(40, stop_token_ids=stops))[0]
    assert len(early.token_ids) == 1 and early.finish_reason == "stop"
    eos = sorted(llm.engine.eos_token_ids)
    for m in (5, 12):
        out = llm.generate([PROMPT], greedy(40, stop_token_ids=stops, min_tokens=m))[0]
        assert len(out.token_ids) > m or out.finish_reason == "length"
        assert not set(out.token_ids[:m]) & set(stops + eos)
        ref = hf_greedy(hf, PROMPT, 40, min_new_tokens=m, eos_token_id=stops + eos)
        assert_greedy_match(out.token_ids, ref, f"min_tokens={m}")
        if out.finish_reason == "stop":
            assert out.stop_reason in stops + eos and out.token_ids[-1] == out.stop_reason


def test_min_tokens_keeps_stop_strings_from_ending_the_text_early(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    tok = llm.get_tokenizer()
    full = llm.generate([PROMPT], greedy(40, ignore_eos=True))[0]
    m = 10
    floor = len(tok.decode(full.token_ids[:m], skip_special_tokens=True))
    stop = full.text[2:5]  # ends inside the first m tokens' text
    assert floor >= 5
    cut = llm.generate([PROMPT], greedy(40, ignore_eos=True, stop=stop))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    held = llm.generate([PROMPT], greedy(40, ignore_eos=True, stop=stop, min_tokens=m))[0]
    # As vLLM: the stop string must end past the text of the first min_tokens tokens.
    at = full.text.find(stop, floor - len(stop) + 1)
    if at == -1:
        assert held.finish_reason == "length" and held.text == full.text
    else:
        assert held.finish_reason == "stop" and held.text == full.text[:at]
        assert len(held.token_ids) > m
    assert held.token_ids == full.token_ids[: len(held.token_ids)]


# ---- bad values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens .17. must not exceed max_tokens .16."),
        ({"logit_bias": {"5": 1.0}}, "logit_bias token id"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id"),
        ({"logit_bias": {True: 1.0}}, "logit_bias token id"),
        ({"logit_bias": {5: 100.5}}, r"logit_bias\[5\]"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\]"),
        ({"logit_bias": {5: "1"}}, r"logit_bias\[5\]"),
        ({"logit_bias": [5, 1]}, "logit_bias must be a dict"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "at most 1024"),
    ],
)
def test_bad_min_tokens_and_logit_bias_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_min_tokens_without_max_tokens_and_an_empty_bias_are_fine():
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0}


def test_an_out_of_vocabulary_bias_is_refused_at_add_request_and_the_batch_runs(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token id {vocab} is not in the vocabulary \[0, {vocab}\)"):
        llm.engine.add_request("x", PROMPT, SamplingParams(logit_bias={3: 1.0, vocab: 1.0, vocab + 5: 2.0}))
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(
        [PROMPT, OTHER], [greedy(5, logit_bias={vocab - 1: 1.0}), greedy(5, logit_bias={vocab * 2: -1.0})]
    )
    assert outs[0].finish_reason in ("length", "stop") and len(outs[0].token_ids) >= 1
    assert outs[1].finish_reason == "error" and "not in the vocabulary" in (outs[1].error or "")
