"""The engine's input boundary: text a tokenizer cannot take (a lone surrogate, from a JSON
``\\udce9`` escape) is that request's error, named, and never sinks the batch; fuzzed with
hypothesis over prompts, messages and stop strings so the next such input is found here."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.outputs import RequestOutput

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
DONE = ("stop", "length")


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(tiny_models("llama"), dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=8)


def _assert_ran(out: RequestOutput) -> None:
    assert out.finish_reason in DONE and out.error is None and out.token_ids, out


def _assert_rejected(out: RequestOutput, *words: str) -> None:
    assert out.finish_reason == "error" and out.error, out
    for word in words:
        assert word in out.error, out.error


def test_a_lone_surrogate_fails_only_its_own_request(llm) -> None:
    outs = llm.generate(
        [
            "hello",
            "caf\udce9",
            {"messages": [{"role": "user", "content": "caf\udce9"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
            "world",
        ],
        ONE_TOKEN,
    )
    assert len(outs) == 5
    _assert_ran(outs[0])
    _assert_rejected(outs[1], "prompt is not valid Unicode text", "lone surrogate", "'\\udce9'")
    _assert_rejected(outs[2], "messages[0].content is not valid Unicode text")
    _assert_rejected(outs[3], "messages[0].content[0].text is not valid Unicode text")
    _assert_ran(outs[4])
    assert not llm.engine.has_unfinished_requests()


def test_a_stop_string_with_a_lone_surrogate_is_a_value_error_naming_stop() -> None:
    with pytest.raises(ValueError, match="stop is not valid Unicode text"):
        SamplingParams(stop=["ok", "x\udce9"])


def test_whatever_the_tokenizer_raises_is_that_requests_error(llm, monkeypatch) -> None:
    def refuse(text: str, **_: Any) -> list[int]:
        if "boom" in text:
            raise TypeError("TextEncodeInput must be Union[...]")
        return original(text, **_)

    original = llm.engine.tokenizer.encode
    monkeypatch.setattr(llm.engine.tokenizer, "encode", refuse)
    outs = llm.generate(["fine", "boom"], ONE_TOKEN)
    _assert_ran(outs[0])
    _assert_rejected(outs[1], "the tokenizer cannot encode the prompt", "TypeError")


# ---- fuzzing ------------------------------------------------------------------------------

# Any code point, surrogates included (hypothesis leaves them out unless asked), and text
# with a lone surrogate spliced in often: among all code points they are too rare to be hit.
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | st.builds(
    lambda head, bad, tail: head + bad + tail, st.text(max_size=10), SURROGATE, st.text(max_size=10)
)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant"]) | ANY_TEXT,
        "content": ANY_TEXT
        | st.none()
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": ANY_TEXT}), max_size=2)
        | JSONISH,
    }
)
PROMPT = (
    ANY_TEXT
    | st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=6)
    | st.builds(lambda m: {"messages": m}, st.lists(MESSAGE, max_size=3) | JSONISH)
    | st.builds(lambda p: {"prompt": p}, ANY_TEXT | JSONISH)
    | JSONISH
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=PROMPT)
def test_any_prompt_ends_as_an_output_and_never_sinks_the_batch(llm, prompt: Any) -> None:
    outs = llm.generate(["a good neighbour", prompt, "another good one"], ONE_TOKEN)
    assert len(outs) == 3
    _assert_ran(outs[0])
    _assert_ran(outs[2])
    fuzzed = outs[1]
    if fuzzed.finish_reason == "error":
        assert isinstance(fuzzed.error, str) and fuzzed.error and "\n" not in fuzzed.error
    else:
        _assert_ran(fuzzed)
    assert not llm.engine.has_unfinished_requests()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stop=ANY_TEXT | st.lists(ANY_TEXT, max_size=4) | JSONISH)
def test_any_stop_value_is_accepted_or_a_value_error_naming_stop(llm, stop: Any) -> None:
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, stop=stop)
    except ValueError as exc:
        assert "stop" in str(exc)
        return
    outs = llm.generate(["a good neighbour", "another"], params)
    for out in outs:
        _assert_ran(out)
