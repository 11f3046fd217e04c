"""Input parsing (OpenAI Batch JSONL, plain JSONL, CSV) and output line builders."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.worker.batchio.output_lines import (
    Choice,
    dumps_line,
    error_line,
    failed_request_line,
    line_error_line,
    output_line,
    response_body,
    stable_id,
)
from conveyor.worker.batchio.readers import detect_format, iter_input
from conveyor.worker.batchio.records import InputError, InputTooLarge, LineError, ParsedRequest
from conveyor.worker.batchio.request_body import CHAT, COMPLETIONS
from tests.worker.helpers import as_line_error, as_request
from tests.worker.lines import LIMITS, batch_line, chat_line, one, parse

# ---- good lines ---------------------------------------------------------------------------


def test_openai_chat_line_maps_to_engine_sampling() -> None:
    body = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        "max_completion_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": "###",
        "seed": 7,
        "n": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logprobs": True,
        "top_logprobs": 5,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "stop_token_ids": [2],
        "ignore_eos": False,
        "stream": False,
        "user": "u1",
        "metadata": {"k": "v"},
    }
    req = one(batch_line(body=body))
    assert isinstance(req, ParsedRequest)
    assert req.line == 1 and req.custom_id == "r1" and req.endpoint == CHAT and req.prompt is None
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    assert req.sampling == {
        "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stop": ["###"], "seed": 7, "n": 2,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 5, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "stop_token_ids": [2], "ignore_eos": False,
    }  # fmt: skip
    assert ParsedRequest.from_json(json.loads(json.dumps(req.to_json()))) == req


def test_openai_completions_line_and_defaults() -> None:
    req = one(batch_line(url=COMPLETIONS, body={"model": "m", "prompt": "Once", "logprobs": 2, "best_of": 1}))
    assert req.endpoint == COMPLETIONS and req.prompt == "Once" and req.messages is None
    assert req.sampling == {"max_tokens": LIMITS.default_max_tokens, "logprobs": 2}
    ids = one(batch_line(url=COMPLETIONS, body={"prompt": [1, 2, 3]}))
    assert ids.prompt == [1, 2, 3]
    assert one(batch_line(url=COMPLETIONS, body={"prompt": ["solo"]})).prompt == "solo"


def test_plain_jsonl_rows() -> None:
    rows = parse(
        {"prompt": "p1", "max_tokens": 8, "label": "ignored", "stream": True},
        b"\n   \n",
        {"messages": [{"role": "user", "content": "hey"}], "id": 17},
        {"prompt": "p3", "custom_id": "mine"},
    )
    assert [(r.line, r.custom_id, r.endpoint) for r in map(as_request, rows)] == [
        (1, "line-1", COMPLETIONS), (4, "17", CHAT), (5, "mine", COMPLETIONS),
    ]  # fmt: skip
    assert as_request(rows[0]).sampling == {"max_tokens": 8}


def test_a_batch_line_without_a_body_names_the_body_and_plain_rows_may_have_a_url() -> None:
    err = as_line_error(one({"custom_id": "r1", "method": "POST", "url": CHAT}))
    assert (err.code, err.param, err.custom_id) == ("missing_prompt", "body", "r1")
    row = as_request(one({"prompt": "p", "url": "https://example.com/page"}))  # a dataset's own column
    assert (row.custom_id, row.endpoint, row.prompt) == ("line-1", COMPLETIONS, "p")
    no_prompt = as_line_error(one({"text": "t", "url": "https://example.com/page"}))
    assert (no_prompt.code, no_prompt.param) == ("missing_prompt", "prompt")


def test_byte_order_mark_and_crlf() -> None:
    rows = parse(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [as_request(r).prompt for r in rows] == ["a", "b"]


def test_sampling_dicts_build_engine_sampling_params(monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(__file__).resolve().parents[3] / "conveyor" / "engine" / "sampling_params.py"
    spec = importlib.util.spec_from_file_location("_sampling_params_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # without importing engine (torch)
    spec.loader.exec_module(module)
    fields = {f.name for f in dataclasses.fields(module.SamplingParams) if f.init}
    body = {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "temperature": 0, "top_p": 0.5,
        "stop": ["a", "b"], "seed": 3, "n": 2, "logprobs": True, "top_k": -1, "min_p": 0.1,
        "stop_token_ids": [1], "ignore_eos": True, "repetition_penalty": 1.2, "presence_penalty": 1,
        "frequency_penalty": 1,
    }  # fmt: skip
    req = one(batch_line(body=body))
    assert set(req.sampling) <= fields
    module.SamplingParams(**req.sampling)  # the engine accepts every value we let through


# ---- malformed lines --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "code", "words"),
    [
        (b"{not json\n", "invalid_json", "invalid JSON"),
        (b"[1, 2]\n", "invalid_request", "JSON object"),
        (b'"just a string"\n', "invalid_request", "JSON object"),
        (b'{"prompt": "\xff"}\n', "invalid_encoding", "UTF-8"),
        (b'{"prompt": "ok"} \xff\xfe\n', "invalid_encoding", "UTF-8"),  # a file starting \xff\xfe is UTF-16
        (b"[" * 100_000 + b"\n", "line_too_long", "longer than"),
        (batch_line(url="/v1/moderations"), "invalid_value", "url must be one of"),
        (batch_line(method="GET"), "invalid_value", 'method must be "POST"'),
        (batch_line(custom_id=None), "invalid_request", "custom_id must be a non-empty string"),
        (batch_line(custom_id=5), "invalid_request", "custom_id"),
        (batch_line(custom_id="x" * 513), "invalid_value", "longer than 512"),
        (batch_line(extra_field=1), "unknown_parameter", "extra_field"),
        (batch_line(body=[]), "invalid_request", "body must be a JSON object"),
        ({"custom_id": "r1", "method": "POST", "url": CHAT}, "missing_prompt", "needs a body with a prompt"),
        ({"custom_id": "r1", "url": COMPLETIONS}, "missing_prompt", "needs a body with a prompt or messages"),
        (batch_line(body={"prompt": "p"}), "missing_prompt", "needs messages"),
        (batch_line(url=COMPLETIONS, body={"messages": []}), "missing_prompt", "needs a prompt"),
        (batch_line(url=COMPLETIONS, body={"prompt": ""}), "invalid_value", "prompt is empty"),
        (batch_line(url=COMPLETIONS, body={"prompt": ["a", "b"]}), "unsupported", "several prompts"),
        (batch_line(url=COMPLETIONS, body={"prompt": [1, -2]}), "invalid_value", "token ids"),
        (batch_line(url=COMPLETIONS, body={"prompt": "p", "best_of": 3}), "unsupported", "best_of"),
        (batch_line(body={"messages": []}), "invalid_value", "non-empty list"),
        (batch_line(body={"messages": "hi"}), "invalid_value", "non-empty list"),
        (batch_line(body={"messages": [{"role": "robot", "content": "x"}]}), "invalid_value", "messages[0].role"),
        (batch_line(body={"messages": [{"role": "tool", "content": "x"}]}), "invalid_value", "tool_call_id"),
        (
            batch_line(body={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "unsupported",
            "only text parts",
        ),
        (batch_line(body={"messages": [{"role": "user", "content": 5}]}), "invalid_value", "content"),
        (chat_line(temperature=3), "invalid_value", "temperature"),
        (chat_line(temperature="hot"), "invalid_value", "temperature"),
        (chat_line(top_p=0), "invalid_value", "top_p"),
        (chat_line(max_tokens=True), "invalid_value", "max_tokens"),
        (chat_line(max_tokens=0), "invalid_value", "max_tokens"),
        (chat_line(max_tokens=10**6), "invalid_value", "4096"),
        (
            chat_line(max_tokens=5, max_completion_tokens=5),
            "invalid_request",
            "not both",
        ),
        (chat_line(n=100), "invalid_value", "n must be"),
        (chat_line(seed=-1), "invalid_value", "seed"),
        (chat_line(stop=["a"] * 17), "invalid_value", "stop"),
        (chat_line(stop=[""]), "invalid_value", "stop"),
        (chat_line(top_logprobs=3), "invalid_request", "logprobs: true"),
        (
            chat_line(logprobs=True, top_logprobs=50),
            "invalid_value",
            "top_logprobs",
        ),
        (chat_line(stream=True), "unsupported", "cannot stream"),
        (chat_line(tools=[{}]), "invalid_value", "tools[0] must be"),
        (chat_line(max_token=5), "unknown_parameter", "max_token"),
        ({"text": "no prompt here"}, "missing_prompt", "no prompt or messages"),
        ({"prompt": 42}, "invalid_value", "prompt must be"),
        ({"prompt": "p", "temperature": -1}, "invalid_value", "temperature"),
    ],
)
def test_bad_lines_become_error_records(line, code: str, words: str) -> None:
    err = one(line)
    assert isinstance(err, LineError), err
    assert err.line == 1 and err.code == code and words in err.message, err


def test_a_bad_line_never_stops_the_rest_and_keeps_its_custom_id() -> None:
    rows = parse(
        batch_line("a"),
        b"{oops\n",
        batch_line("b", body={"messages": [{"role": "user", "content": "x"}], "n": 0}),
        b'{"prompt": "' + b"x" * 5000 + b'"}\n',
        batch_line("c"),
    )
    assert [type(r).__name__ for r in rows] == ["ParsedRequest", "LineError", "LineError", "LineError", "ParsedRequest"]
    assert [r.line for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2].custom_id == "b" and as_line_error(rows[2]).param == "n"


def test_duplicate_custom_ids_are_rejected_naming_the_first_line() -> None:
    rows = parse(batch_line("a"), batch_line("b"), batch_line("a"), {"prompt": "p", "id": "b"}, batch_line("a"))
    assert [r.custom_id for r in rows] == ["a", "b", "a", "b", "a"]
    dups = [r for r in rows if isinstance(r, LineError)]
    assert [(d.line, d.code) for d in dups] == [
        (3, "duplicate_custom_id"),
        (4, "duplicate_custom_id"),
        (5, "duplicate_custom_id"),
    ]
    assert "already used on line 1" in dups[0].message and "line 2" in dups[1].message


def test_a_rejected_line_still_claims_its_custom_id() -> None:
    rows = parse(batch_line("a", method="GET"), batch_line("a"))
    assert [as_line_error(r).code for r in rows] == ["invalid_value", "duplicate_custom_id"]


def test_batch_lines_share_one_url_and_a_line_asking_for_another_is_its_own_error() -> None:
    completion = batch_line("c", url=COMPLETIONS, body={"prompt": "p"})
    rows = parse(batch_line("a"), {"prompt": "plain rows do not count"}, b"\n", batch_line("b"), completion)
    assert [as_request(r).custom_id for r in rows[:3]] == ["a", "line-2", "b"]
    mismatch = as_line_error(rows[3])
    assert (mismatch.code, mismatch.line, mismatch.param, mismatch.custom_id) == ("url_mismatch", 5, "url", "c")
    assert "/v1/completions" in mismatch.message and "line 1" in mismatch.message and "one endpoint" in mismatch.message
    # A line rejected for its body still fixes the url; a url we do not serve is only a line error.
    rows = parse(batch_line("a", body={"messages": []}), completion)
    assert [as_line_error(r).code for r in rows] == ["invalid_value", "url_mismatch"]
    rows = parse(batch_line("x", url="/v1/moderations"), completion, batch_line("y", url=None))
    assert [type(r).__name__ for r in rows] == ["LineError", "ParsedRequest", "LineError"]
    # Plain rows may mix prompts and messages (each runs as its own endpoint).
    rows = parse({"prompt": "p"}, {"messages": [{"role": "user", "content": "x"}]})
    assert [as_request(r).endpoint for r in rows] == [COMPLETIONS, CHAT]


# ---- limits -------------------------------------------------------------------------------


def test_line_count_limit_is_a_whole_input_error() -> None:
    limits = dataclasses.replace(LIMITS, max_lines=3)
    assert len(parse(*[{"prompt": "p"}] * 3, b"\n\n", limits=limits)) == 3  # blank lines are free
    with pytest.raises(InputTooLarge, match="more than 3 lines"):
        parse(*[{"prompt": "p"}] * 4, limits=limits)


def test_input_byte_limit_is_a_whole_input_error() -> None:
    limits = dataclasses.replace(LIMITS, max_input_bytes=100)
    with pytest.raises(InputTooLarge, match="larger than 100 bytes"):
        parse(*[{"prompt": "p" * 10}] * 10, limits=limits)


def test_line_byte_limit_counts_the_line_without_its_newline() -> None:
    limits = dataclasses.replace(LIMITS, max_line_bytes=64)
    exact = b'{"prompt": "' + b"x" * (64 - 14) + b'"}\r\n'
    assert len(exact.rstrip()) == 64
    ok, long_ = parse(exact, b'{"prompt": "' + b"x" * (64 - 13) + b'"}', limits=limits)
    assert isinstance(ok, ParsedRequest) and isinstance(long_, LineError) and long_.code == "line_too_long"


def test_parsing_streams_without_reading_the_whole_input() -> None:
    class Endless(io.RawIOBase):
        """An input that never ends: only a streaming parser can answer."""

        def __init__(self) -> None:
            self.served = 0

        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            chunk = (b'{"prompt": "hello"}\n' * 1000)[: len(buffer)]
            buffer[: len(chunk)] = chunk
            self.served += len(chunk)
            return len(chunk)

    raw = Endless()
    rows = iter_input(io.BufferedReader(raw), LIMITS)
    first = [next(rows) for _ in range(3)]
    assert [r.custom_id for r in first] == ["line-1", "line-2", "line-3"]
    assert raw.served < 1 << 20


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_crash_the_parser(data: bytes) -> None:
    limits = dataclasses.replace(LIMITS, max_line_bytes=128)
    for fmt in ("jsonl", "csv"):
        try:
            for row in iter_input(io.BytesIO(data), limits, fmt):
                assert isinstance(row, (ParsedRequest, LineError)) and row.line >= 1
        except InputError:
            pass


# ---- CSV ----------------------------------------------------------------------------------


def test_csv_with_a_prompt_column() -> None:
    data = (
        b"\xef\xbb\xbfcustom_id,Prompt,temperature,stop,notes\n"
        b'r1,"multi\nline prompt",0.2,"[""a"",""b""]",x\n'
        b"\n"
        b",plain,,###,\n"
        b"r3,,,,\n"
        b"r4,hi,hot,,\n"
        b"r5,a,b,c,d,e\n"
        b"r1,dup,,,\n"
    )
    rows = list(iter_input(io.BytesIO(data), LIMITS, detect_format("in.CSV")))
    assert [(r.line, type(r).__name__) for r in rows] == [
        (2, "ParsedRequest"), (5, "ParsedRequest"), (6, "LineError"), (7, "LineError"), (8, "LineError"),
        (9, "LineError"),
    ]  # fmt: skip
    assert as_request(rows[0]).prompt == "multi\nline prompt" and rows[0].custom_id == "r1"
    assert as_request(rows[0]).sampling == {
        "max_tokens": LIMITS.default_max_tokens,
        "temperature": 0.2,
        "stop": ["a", "b"],
    }
    assert rows[1].custom_id == "line-5" and as_request(rows[1]).sampling["stop"] == ["###"]
    assert "prompt is empty" in as_line_error(rows[2]).message and rows[2].custom_id == "r3"
    assert as_line_error(rows[3]).param == "temperature"
    assert "6 fields" in as_line_error(rows[4]).message
    assert as_line_error(rows[5]).code == "duplicate_custom_id"


def test_csv_without_a_prompt_column_is_refused() -> None:
    with pytest.raises(InputError, match="no 'prompt', 'messages' or 'input' column"):
        list(iter_input(io.BytesIO(b"text,id\nhello,1\n"), LIMITS, "csv"))


def test_csv_unclosed_quote_is_bounded_and_parsing_resumes() -> None:
    limits = dataclasses.replace(LIMITS, max_line_bytes=100)
    data = b'prompt\nfine\n"never closed\n' + (b"y" * 60 + b"\n") * 3 + b"after\n"
    rows = list(iter_input(io.BytesIO(data), limits, "csv"))
    assert [(r.line, getattr(r, "code", None)) for r in rows] == [
        (2, None), (3, "line_too_long"), (6, None), (7, None),
    ]  # fmt: skip
    assert as_request(rows[-1]).prompt == "after"


# ---- output lines -------------------------------------------------------------------------


def test_chat_output_line() -> None:
    body = response_body(
        CHAT, response_id="chatcmpl-1", model="m", created=1700000000,
        choices=[Choice("Hello!", "stop")], prompt_tokens=10, completion_tokens=3, cached_tokens=8,
    )  # fmt: skip
    line = output_line("batch_1", "r1", body)
    assert line["custom_id"] == "r1" and line["error"] is None
    assert line["id"].startswith("batch_req_") and line["id"] == output_line("batch_1", "r1", body)["id"]
    assert line["id"] != output_line("batch_2", "r1", body)["id"]
    response = line["response"]
    assert response["status_code"] == 200 and response["request_id"].startswith("req_")
    assert response["body"]["object"] == "chat.completion"
    assert response["body"]["choices"][0]["message"] == {"role": "assistant", "content": "Hello!", "refusal": None}
    assert response["body"]["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 8},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip
    encoded = dumps_line(line)
    assert encoded.endswith(b"\n") and encoded.count(b"\n") == 1 and json.loads(encoded) == line


def test_completion_output_and_error_lines() -> None:
    body = response_body(
        COMPLETIONS, response_id="cmpl-1", model="m", created=1,
        choices=[Choice("a", "length"), Choice("b", "stop")], prompt_tokens=1, completion_tokens=2,
    )  # fmt: skip
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["a", "b"] and body["choices"][1]["index"] == 1
    with pytest.raises(ValueError, match="unknown endpoint"):
        response_body(
            "/v1/embeddings", response_id="x", model="m", created=1, choices=[], prompt_tokens=0, completion_tokens=0
        )

    # A request that ran and got an HTTP error: the error is in the response, as OpenAI's.
    ran = failed_request_line("batch_1", "r9", status_code=400, code="prompt_too_long", message="too long", line=9)
    assert ran["error"] is None and ran["custom_id"] == "r9"
    assert ran["response"]["status_code"] == 400 and ran["response"]["request_id"].startswith("req_")
    assert ran["response"]["body"] == {
        "error": {"message": "too long", "type": "invalid_request_error", "param": None, "code": "prompt_too_long"}
    }
    crashed = failed_request_line("batch_1", "r9", status_code=500, code="engine_error", message="boom", line=9)
    assert crashed["response"]["body"]["error"]["type"] == "server_error" and crashed["error"] is None

    # A line that could not run at all: `error`, no response.
    (err,) = parse(b"{bad\n")
    rejected = line_error_line("batch_1", as_line_error(err))
    assert rejected["custom_id"] == "line-1" and rejected["response"] is None
    assert rejected["error"]["line"] == 1 and rejected["error"]["code"] == "invalid_json"
    named = error_line("batch_1", "r3", code="invalid_value", message="m", line=3, param="n")
    assert named["response"] is None
    assert named["error"] == {"code": "invalid_value", "message": "m", "param": "n", "line": 3}
    assert stable_id("x_", "a", "b") == stable_id("x_", "a", "b") != stable_id("x_", "ab")
