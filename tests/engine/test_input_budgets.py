"""A request's input work is bounded: a grammar past its compile budget and a prompt too long
for the engine are refused, alone, with their own codes; a prompt prepared on another thread
runs exactly as one given whole."""

from __future__ import annotations

import threading
import time

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from conveyor.engine import SamplingParams, StructuredOutputs
from conveyor.engine.inputs.errors import GRAMMAR_TOO_COMPLEX, PROMPT_TOO_LONG, InputRejected
from conveyor.engine.inputs.prompt_bounds import bytes_per_token_bound, min_tokens
from conveyor.testing.tiny_models import corpus


def pattern_schema(n: int, salt: str = "") -> dict:
    """llguidance compiles a schema's ``patternProperties`` superlinearly in their number
    (200: under a second, 400: tens of seconds, 700: minutes)."""
    return {"type": "object", "patternProperties": {f"^k{salt}{i}[a-z]+x$": {"type": "integer"} for i in range(n)}}


def _json(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputs(json=schema), max_tokens=8, temperature=0.0, **kw)


@pytest.fixture
def llm(tiny_models, make_llm):
    return make_llm(tiny_models("llama"), grammar_compile_seconds=1.0)


def test_a_grammar_past_its_budget_is_refused_and_its_compile_stopped(llm) -> None:
    engine = llm.engine
    begin = time.monotonic()
    with pytest.raises(InputRejected) as refused:
        engine.prepare_input("Describe an object.", _json(pattern_schema(500)))
    took = time.monotonic() - begin
    assert refused.value.code == GRAMMAR_TOO_COMPLEX
    assert "CONVEYOR_GRAMMAR_COMPILE_SECONDS" in str(refused.value)
    assert took < 10, took  # the budget (1 s) and a child's start, not the compile's minutes
    assert engine.structured.probe.kills == 1

    # The verdict is cached: the same schema again costs nothing and kills nothing.
    begin = time.monotonic()
    with pytest.raises(InputRejected):
        engine.prepare_input("Describe an object.", _json(pattern_schema(500)))
    assert time.monotonic() - begin < 0.5
    assert engine.structured.probe.kills == 1

    # The next grammar gets a new child and runs; the other requests of a batch are untouched.
    ok_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    outs = llm.generate(
        ["one", "two", "three"], [_json(ok_schema), _json(pattern_schema(500, "b")), SamplingParams(max_tokens=4)]
    )
    assert outs[0].error is None and outs[2].error is None
    assert outs[1].finish_reason == "error" and "compile" in outs[1].error
    assert engine.structured.probe.kills == 2


def test_the_engine_keeps_stepping_while_another_thread_compiles(tiny_models, make_llm) -> None:
    """The compile runs in a child process and its thread waits without the GIL: a request
    generated meanwhile finishes while the compile is still going, with the same tokens."""
    llm = make_llm(tiny_models("llama"), grammar_compile_seconds=5.0)
    engine = llm.engine
    result: dict[str, InputRejected] = {}

    def compile_it() -> None:
        try:
            engine.prepare_input("x", _json(pattern_schema(600, "c")))
        except InputRejected as exc:
            result["exc"] = exc

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    (alone,) = llm.generate(["a steady stream"], params)
    thread = threading.Thread(target=compile_it)
    thread.start()
    (beside,) = llm.generate(["a steady stream"], params)
    still_compiling = thread.is_alive()
    thread.join()
    assert still_compiling
    assert isinstance(result.get("exc"), InputRejected) and result["exc"].code == GRAMMAR_TOO_COMPLEX
    assert beside.token_ids == alone.token_ids


def test_an_over_long_prompt_is_refused_from_its_bytes_before_tokenising(llm, monkeypatch) -> None:
    engine = llm.engine
    bound = engine.inputs.max_bytes_per_token
    assert bound is not None
    text = "lorem ipsum " * (engine.max_request_tokens * bound // 12 + 1)
    calls = []
    real_encode = engine.tokenizer.encode

    def counting_encode(*args, **kwargs):
        calls.append(1)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", counting_encode)
    with pytest.raises(InputRejected) as refused:
        engine.prepare_input(text)
    assert refused.value.code == PROMPT_TOO_LONG and "at least" in str(refused.value)
    assert calls == []
    # Just over the length in tokens (not in bytes): tokenised, then refused with the same code.
    short = " ".join(corpus(400))
    ids = real_encode(short)
    assert len(ids) >= engine.max_request_tokens, "the corpus must outgrow the tiny engine"
    with pytest.raises(InputRejected) as counted:
        engine.prepare_input(short)
    assert counted.value.code == PROMPT_TOO_LONG and f"{len(ids)} tokens" in str(counted.value)


def test_the_byte_bound_never_exceeds_the_true_count(tiny_models) -> None:
    """A lower bound that is never above the real count, over texts that stress it."""
    tok = AutoTokenizer.from_pretrained(tiny_models("llama"))
    per_token = bytes_per_token_bound(tok)
    assert per_token is not None
    texts = [" ".join(corpus(50)), "     " * 400, "é" * 300 + "e\u0301" * 300, "😀" * 200, "\n\t" * 500, "ab" * 2000]
    for text in texts:
        assert min_tokens(text, per_token) <= len(tok.encode(text, add_special_tokens=False)), text[:20]
    # BERT's normalizer deletes control characters, and a token that strips the spaces around
    # it swallows any number of them: no bound is claimed for either.
    bert = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    bert.normalizer = normalizers.BertNormalizer()
    assert bytes_per_token_bound(PreTrainedTokenizerFast(tokenizer_object=bert)) is None
    plain = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert bytes_per_token_bound(PreTrainedTokenizerFast(tokenizer_object=plain)) == 5
    plain.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert bytes_per_token_bound(PreTrainedTokenizerFast(tokenizer_object=plain)) is None


def test_a_prepared_input_runs_exactly_as_the_raw_prompt(llm) -> None:
    engine = llm.engine
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [SamplingParams(max_tokens=12, seed=7, temperature=0.8), _json(schema)]
    raw = llm.generate(["The weather is", "Describe it"], params)
    prepared = [engine.prepare_input(p, sp) for p, sp in zip(["The weather is", "Describe it"], params, strict=True)]
    for i, (item, sp) in enumerate(zip(prepared, params, strict=True)):
        engine.add_request(f"prep-{i}", item, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert [outs[f"prep-{i}"].token_ids for i in range(2)] == [o.token_ids for o in raw]
    with pytest.raises(ValueError, match="prepared for"):
        engine.add_request("prep-x", engine.prepare_input("x", params[0]), SamplingParams())
