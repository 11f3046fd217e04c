"""The OpenAI request-body fields beyond sampling basics: logit_bias, min_tokens, echo, suffix,
the logprobs shapes, and fields accepted and ignored. Checked line by line, then through
``conveyor run`` with every output line typed by the ``openai`` SDK."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from transformers import AutoTokenizer

from conveyor.engine import SamplingParams
from conveyor.worker.batchio.records import ParsedRequest
from conveyor.worker.batchio.request_body import COMPLETIONS
from conveyor.worker.entrypoints.cli import main
from tests.engine.reference import oracle_model
from tests.worker.helpers import as_line_error, as_request, jsonl
from tests.worker.lines import LIMITS as FORMAT_LIMITS
from tests.worker.lines import batch_line, chat_line, one
from tests.worker.openai_shapes import BatchRequestOutput, check_output_line

LIMITS = dataclasses.replace(FORMAT_LIMITS, max_line_bytes=64 * 1024)  # room for 300 biases


def completions_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    return batch_line(custom_id=custom_id, url=COMPLETIONS, body={"prompt": "The chef", **body})


# ---- line by line -----------------------------------------------------------------------------


def test_logit_bias_and_min_tokens_reach_the_engines_sampling_params() -> None:
    for line in (
        chat_line(logit_bias={"5": -100, "17": 2.5, "0": 100}, min_tokens=3, max_tokens=8),
        completions_line(logit_bias={"5": -100, "17": 2.5, "0": 100}, min_tokens=3, max_tokens=8),
    ):
        req = as_request(one(line, LIMITS))
        assert req.sampling["logit_bias"] == {5: -100.0, 17: 2.5, 0: 100.0}
        assert req.sampling["min_tokens"] == 3
        params = SamplingParams(**req.sampling)
        assert params.logit_bias == {5: -100.0, 17: 2.5, 0: 100.0} and params.min_tokens == 3
        # Through a shard file (JSON keys are strings) and back: the same engine values.
        again = ParsedRequest.from_json(json.loads(json.dumps(req.to_json())))
        assert again == req


def test_echo_is_a_completions_flag_kept_out_of_sampling() -> None:
    req = as_request(one(completions_line(echo=True)))
    assert req.echo and "echo" not in req.sampling
    assert ParsedRequest.from_json(json.loads(json.dumps(req.to_json()))).echo
    plain = as_request(one(completions_line(echo=False)))
    assert not plain.echo and "echo" not in plain.to_json()
    assert not as_request(one(chat_line(echo=False))).echo


def test_echo_with_logprobs_asks_the_engine_for_the_prompts_logprobs_too() -> None:
    req = as_request(one(completions_line(echo=True, logprobs=2)))
    assert req.echo and req.sampling["logprobs"] == req.sampling["prompt_logprobs"] == 2
    assert "prompt_logprobs" not in as_request(one(completions_line(logprobs=2))).sampling
    assert SamplingParams(**req.sampling).prompt_logprobs == 2


def test_user_metadata_and_other_harmless_fields_are_accepted_and_ignored() -> None:
    for line in (
        chat_line(user="u-1", metadata={"k": "v"}, safety_identifier="h", prompt_cache_key="p", store=False),
        completions_line(user="u-1", suffix="", echo=False, logit_bias={}),
    ):
        req = as_request(one(line))
        assert set(req.sampling) <= {"max_tokens", "logit_bias"}
        assert SamplingParams(**req.sampling).logit_bias is None


@pytest.mark.parametrize(
    ("line", "code", "param", "words"),
    [
        (chat_line(logit_bias={"abc": 1}), "invalid_value", "logit_bias", "keyed by token ids"),
        (chat_line(logit_bias={"1.5": 1}), "invalid_value", "logit_bias", "keyed by token ids"),
        (chat_line(logit_bias={"-1": 1}), "invalid_value", "logit_bias", "keyed by token ids"),
        (chat_line(logit_bias={"12345678901": 1}), "invalid_value", "logit_bias", "keyed by token ids"),
        (chat_line(logit_bias={"5": 101}), "invalid_value", "logit_bias[5]", "at most 100"),
        (chat_line(logit_bias={"5": -100.5}), "invalid_value", "logit_bias[5]", "at least -100"),
        (chat_line(logit_bias={"5": "1"}), "invalid_value", "logit_bias[5]", "a number"),
        (chat_line(logit_bias={"5": True}), "invalid_value", "logit_bias[5]", "a number"),
        (chat_line(logit_bias=[[5, 1]]), "invalid_value", "logit_bias", "an object"),
        (
            chat_line(logit_bias={str(i): 1 for i in range(301)}),
            "invalid_value",
            "logit_bias",
            "301 entries; at most 300",
        ),
        (chat_line(min_tokens=-1), "invalid_value", "min_tokens", "an integer from 0"),
        (chat_line(min_tokens=9, max_tokens=8), "invalid_value", "min_tokens", "must not exceed max_tokens (8)"),
        (chat_line(min_tokens=300), "invalid_value", "min_tokens", "must not exceed max_tokens (256)"),
        (chat_line(echo=True), "unsupported", "echo", "echo is a completions parameter"),
        (completions_line(echo="yes"), "invalid_value", "echo", "true or false"),
        (completions_line(suffix="!"), "unsupported", "suffix", "fill-in-the-middle"),
        (chat_line(logprobs=True, top_logprobs=2, user=5), "unsupported", "user", "user"),
        (chat_line(reasoning_effort="extreme"), "invalid_value", "reasoning_effort", "one of"),
        (completions_line(reasoning_effort="low"), "unknown_parameter", "reasoning_effort", "unknown parameter"),
    ],
)
def test_bad_body_fields_are_that_lines_error(line, code: str, param: str, words: str) -> None:
    err = as_line_error(one(line, LIMITS))
    assert (err.code, err.param) == (code, param) and words in err.message, err


def test_the_logit_bias_bound_is_a_limit_an_operator_sets() -> None:
    line = chat_line(logit_bias={str(i): 1 for i in range(301)})
    assert as_line_error(one(line, LIMITS)).param == "logit_bias"
    assert as_request(one(line, dataclasses.replace(LIMITS, max_logit_bias=400))).sampling["logit_bias"][300] == 1


# ---- through `conveyor run` ---------------------------------------------------------------


def _run(stack: Any, tmp_path: Path, rows: list[Any], capsys: pytest.CaptureFixture[str]):
    """``conveyor run`` over ``rows``: (results, errors) by custom_id, each line checked."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(rows))
    out, err = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    assert main(["run", str(path), "--model", stack.model, "-o", str(out), "--errors", str(err), "-q"]) == 0
    capsys.readouterr()
    results = {r.custom_id: r for r in _lines(out, results=True)}
    errors = {e.custom_id: e for e in _lines(err, results=False)}
    return results, errors


def _lines(path: Path, *, results: bool) -> list[BatchRequestOutput]:
    if not path.exists():
        return []
    return [check_output_line(text, results=results) for text in path.read_text().splitlines()]


def _body(line: BatchRequestOutput) -> dict[str, Any]:
    assert line.response is not None
    return line.response.body


def test_completions_fields_through_conveyor_run(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    tok = AutoTokenizer.from_pretrained(stack.model)
    vocab = len(tok)
    forced = tok.get_vocab()["Ġsoup"]  # " soup": a word of the tiny models' corpus
    prompt = "The chef cooks dish 7 and"
    greedy = {"temperature": 0, "max_tokens": 6}
    rows = [
        completions_line("echo", prompt=prompt, echo=True, **greedy),
        completions_line("plain", prompt=prompt, **greedy),
        completions_line("echo-ids", prompt=tok.encode("Warm bread"), echo=True, **greedy),
        completions_line("forced", prompt=prompt, logit_bias={str(forced): 100}, **greedy),
        # The forced token is also a stop token: it ends the text at once, unless min_tokens
        # masks it (-inf beats +100) for the first 4 tokens: then it is the 5th.
        completions_line("early", prompt=prompt, logit_bias={str(forced): 100}, stop_token_ids=[forced], **greedy),
        completions_line(
            "min", prompt=prompt, logit_bias={str(forced): 100}, stop_token_ids=[forced], min_tokens=4, **greedy
        ),
        completions_line("lp", prompt=prompt, logprobs=2, **greedy),
        completions_line("oov", prompt=prompt, logit_bias={str(vocab + 10): -100}, **greedy),
        completions_line("key", prompt=prompt, logit_bias={"soup": 1}, **greedy),
        completions_line("value", prompt=prompt, logit_bias={"5": 200}, **greedy),
        completions_line("many", prompt=prompt, logit_bias={str(i): 1 for i in range(301)}, **greedy),
        completions_line("minmax", prompt=prompt, min_tokens=7, **greedy),
        completions_line("echo-lp", prompt=prompt, echo=True, logprobs=1, **greedy),
        completions_line("suffix", prompt=prompt, suffix=" the end", **greedy),
    ]
    results, errors = _run(stack, tmp_path, rows, capsys)
    assert set(results) == {"echo", "plain", "echo-ids", "forced", "early", "min", "lp", "echo-lp"}
    text = {
        cid: Completion.model_validate(_body(line), strict=True).choices[0].text
        for cid, line in results.items()
        if cid != "echo-lp"  # its first token's logprob is null: read below as JSON
    }
    assert text["echo"] == prompt + text["plain"]
    assert text["echo-ids"].startswith("<s>Warm bread")  # the ids as sent, BOS included
    assert text["forced"] == tok.decode([forced] * 6)
    for cid, count in (("early", 1), ("min", 5)):
        body = _body(results[cid])
        assert body["usage"]["completion_tokens"] == count and body["choices"][0]["finish_reason"] == "stop"
    assert forced not in tok.encode(text["min"], add_special_tokens=False)[:4]
    logprobs = Completion.model_validate(_body(results["lp"]), strict=True).choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert logprobs.text_offset is not None
    n = len(logprobs.tokens)
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == n
    assert all(len(top) in (2, 3) for top in logprobs.top_logprobs)  # the 2 best, and the chosen one
    assert "".join(logprobs.tokens) == text["lp"]
    # echo with logprobs: the prompt's tokens first, each with transformers' logprob of it
    # (the first with none, as OpenAI gives it), then the generated ones. Read as JSON: the
    # SDK's type has no room for the first token's null.
    echo_lp = _body(results["echo-lp"])
    choice = echo_lp["choices"][0]
    assert choice["text"] == prompt + text["plain"]
    ids = tok(prompt).input_ids
    n_prompt = len(ids)
    lp = choice["logprobs"]
    assert echo_lp["usage"]["prompt_tokens"] == n_prompt
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n_prompt + 6
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # The same tokens from two requests batched differently: float32 rounds each batch's
    # matmuls its own way (a fresh-clone run saw 1.08e-5 on a logprob of -1.48: 7e-6 relative).
    assert lp["tokens"][n_prompt:] == logprobs.tokens and lp["token_logprobs"][n_prompt:] == pytest.approx(
        logprobs.token_logprobs, rel=1e-5, abs=1e-5
    )
    with torch.no_grad():
        hf = oracle_model(stack.model)
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    want = [float(ref[i, ids[i + 1]]) for i in range(n_prompt - 1)]
    assert lp["token_logprobs"][1:n_prompt] == pytest.approx(want, abs=1e-4)
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][n_prompt] == len(prompt), "the generated text starts after the echoed prompt"
    assert lp["text_offset"][:n_prompt] == sorted(lp["text_offset"][:n_prompt])
    # The bad ones: each on its own line, named; the rest of the job ran.
    oov = errors["oov"].response
    assert oov is not None and oov.status_code == 400
    assert f"logit_bias token id {vocab + 10} is not in the vocabulary" in oov.body["error"]["message"]
    expected = {
        "key": ("invalid_value", "logit_bias"),
        "value": ("invalid_value", "logit_bias[5]"),
        "many": ("invalid_value", "logit_bias"),
        "minmax": ("invalid_value", "min_tokens"),
        "suffix": ("unsupported", "suffix"),
    }
    assert set(errors) == {"oov", *expected}
    for cid, (code, param) in expected.items():
        error = errors[cid].error
        assert error is not None and (error.code, error.param) == (code, param), error


def test_chat_fields_through_conveyor_run(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    tok = AutoTokenizer.from_pretrained(stack.model)
    messages = [{"role": "user", "content": "Bring soup to the guest"}]
    greedy: dict[str, Any] = {"messages": messages, "temperature": 0, "max_tokens": 5}
    forced = tok.get_vocab()["Ġtea"]
    rows = [
        batch_line("forced", body={**greedy, "logit_bias": {str(forced): 100}, "min_tokens": 2}),
        batch_line(
            "lp",
            body={**greedy, "logprobs": True, "top_logprobs": 2, "user": "u", "metadata": {"team": "soup"}},
        ),
        batch_line("lp0", body={**greedy, "logprobs": True}),
        batch_line("oov", body={**greedy, "logit_bias": {"99999": 1}}),
    ]
    results, errors = _run(stack, tmp_path, rows, capsys)
    forced_text = ChatCompletion.model_validate(_body(results["forced"]), strict=True).choices[0].message.content
    assert forced_text == tok.decode([forced] * 5)
    choice = ChatCompletion.model_validate(_body(results["lp"]), strict=True).choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        if "\ufffd" not in entry.token:  # a whole character or more: its text's bytes
            assert entry.bytes == list(entry.token.encode())
    # A token that is part of a character has U+FFFD as its text but its own bytes, so the
    # bytes of all tokens decode to the whole output (a random model's output may hold bytes
    # that are no UTF-8 at all: U+FFFD in the text, the bytes themselves in ``bytes``).
    raw = bytes(b for e in choice.logprobs.content for b in e.bytes or [])
    assert raw.decode("utf-8", errors="replace") == choice.message.content
    zero = ChatCompletion.model_validate(_body(results["lp0"]), strict=True).choices[0].logprobs
    assert zero is not None and zero.content and all(e.top_logprobs == [] for e in zero.content)
    oov = errors["oov"].response
    assert oov is not None and oov.status_code == 400 and "not in the vocabulary" in oov.body["error"]["message"]
