"""response_format, structured_outputs and tools in OpenAI batch lines: parsing, the tool-call
parsers, and whole jobs through ``conveyor run`` and the queued path whose every output line
validates against its schema (the model is a tiny random-weight one: its free text is garbage)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from conveyor.worker.batchio.records import LineError, ParsedRequest
from conveyor.worker.batchio.request_body import COMPLETIONS
from conveyor.worker.batchio.tool_parsers import parse_tool_calls
from conveyor.worker.batchio.tools import NAMED, REQUIRED, ToolRequest, answer
from conveyor.worker.core.limits import InputLimits
from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from tests.structured_schemas import SCHEMAS, validate
from tests.worker.helpers import REPO, as_request, jsonl, parse_lines
from tests.worker.lines import batch_line, chat_line
from tests.worker.lines import one as one_with

STRUCTURED_EXAMPLE = REPO / "examples" / "structured.jsonl"

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
BOOK: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "book_table",
        "parameters": {
            "$defs": {"when": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
            "type": "object",
            "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 12}, "at": {"$ref": "#/$defs/when"}},
            "required": ["guests", "at"],
            "additionalProperties": False,
        },
    },
}
FUNCTIONS: dict[str, Any] = {
    "get_weather": WEATHER["function"]["parameters"],
    "book_table": BOOK["function"]["parameters"],
}


def one(line: dict[str, Any]) -> ParsedRequest | LineError:
    """One line parsed under the default limits (lines up to 1 MiB)."""
    return one_with(line, limits=InputLimits())


def json_schema(schema: dict[str, Any], name: str = "out") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ---- request bodies -------------------------------------------------------------------------


def test_response_format_maps_to_structured_outputs() -> None:
    schema = SCHEMAS["refs"]
    assert as_request(one(chat_line(response_format=json_schema(schema)))).sampling["structured_outputs"] == {
        "json": schema
    }
    assert as_request(one(chat_line(response_format={"type": "json_object"}))).sampling["structured_outputs"] == {
        "json_object": True
    }
    assert "structured_outputs" not in as_request(one(chat_line(response_format={"type": "text"}))).sampling
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert as_request(one(chat_line(response_format=no_schema))).sampling["structured_outputs"] == {"json_object": True}
    completion = batch_line(url=COMPLETIONS, body={"prompt": "p", "response_format": json_schema(schema)})
    assert as_request(one(completion)).sampling["structured_outputs"] == {"json": schema}


@pytest.mark.parametrize(
    "value",
    [{"choice": ["a", "b"]}, {"regex": "[0-9]+"}, {"grammar": 'start: "x"'}, {"json": '{"type": "integer"}'}],
)
def test_the_structured_outputs_extension(value) -> None:
    sampling = as_request(one(chat_line(structured_outputs=value))).sampling
    kind = next(iter(value))
    assert next(iter(sampling["structured_outputs"])) == kind


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


HUGE = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 9} for i in range(3000)}}


@pytest.mark.parametrize(
    ("line", "code", "words"),
    [
        (chat_line(response_format={"type": "yaml"}), "invalid_value", "response_format must be"),
        (chat_line(response_format={"type": "json_schema"}), "invalid_value", "name and schema"),
        (
            chat_line(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            "invalid_value",
            ".name must be",
        ),
        (chat_line(response_format=json_schema([1])), "invalid_value", "JSON Schema object"),  # type: ignore[arg-type]
        (chat_line(response_format=json_schema(HUGE)), "invalid_value", "bytes as JSON; at most 65536"),
        (chat_line(response_format=json_schema(_deep(40))), "invalid_value", "more than 32 levels"),
        (
            chat_line(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "x": 1}}),
            "unknown_parameter",
            "json_schema.x",
        ),
        (
            chat_line(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "invalid_request",
            "not both",
        ),
        (chat_line(structured_outputs={"choice": []}), "invalid_value", "list of 1 to 256 strings"),
        (chat_line(structured_outputs={"choice": ["a", ""]}), "invalid_value", "non-empty strings"),
        (chat_line(structured_outputs={"regex": "a", "grammar": "b"}), "invalid_value", "exactly one of"),
        (chat_line(structured_outputs={"json": "{nope"}), "invalid_value", "not valid JSON"),
        (chat_line(structured_outputs={"yaml": "a"}), "unknown_parameter", "structured_outputs.yaml"),
        (chat_line(tools=[{"type": "code"}]), "invalid_value", "tools[0] must be"),
        (chat_line(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "invalid_value", "name must be"),
        (chat_line(tools=[WEATHER, WEATHER]), "invalid_value", "unique"),
        (chat_line(tools=[WEATHER] * 129), "invalid_value", "at most 128 tools"),
        (
            chat_line(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "invalid_value",
            "not in tools",
        ),
        (chat_line(tools=[WEATHER], tool_choice="always"), "invalid_value", "tool_choice must be"),
        (chat_line(tool_choice="required"), "invalid_value", "tool_choice needs tools"),
        (
            chat_line(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
            "invalid_request",
            "forces a call",
        ),
        (chat_line(tools=[WEATHER], parallel_tool_calls="yes"), "invalid_value", "parallel_tool_calls"),
        (batch_line(url=COMPLETIONS, body={"prompt": "p", "tools": [WEATHER]}), "unsupported", "chat/completions only"),
        (
            chat_line(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]),
            "invalid_value",
            "tool_calls[0] must be",
        ),
    ],
)
def test_bad_structured_bodies_are_line_errors(line, code: str, words: str) -> None:
    err = one(line)
    assert isinstance(err, LineError), err
    assert err.code == code and words in err.message, err


def test_tools_travel_in_the_shard_file_and_force_a_grammar() -> None:
    req = as_request(one(chat_line(tools=[WEATHER, BOOK], tool_choice="required", parallel_tool_calls=False)))
    assert req.tools is not None and req.tools.choice == REQUIRED and not req.tools.parallel
    again = ParsedRequest.from_json(json.loads(json.dumps(req.to_json())))
    assert again == req
    schema = req.sampling["structured_outputs"]["json"]
    assert schema["maxItems"] == 1 and schema["$defs"] == {
        "when": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}
    }
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["arguments"]  # moved to the root
    named = as_request(
        one(chat_line(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    )
    assert named.tools is not None and named.tools.choice == NAMED
    assert named.sampling["structured_outputs"] == {"json": FUNCTIONS["get_weather"]}
    auto = as_request(one(chat_line(tools=[WEATHER])))
    assert auto.tools is not None and auto.tools.choice == "auto" and "structured_outputs" not in auto.sampling
    assert as_request(one(chat_line(tools=[], tool_choice="none"))).tools is None


# ---- tool-call parsers --------------------------------------------------------------------------

NAMES = ["get_weather", "book_table"]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (  # Hermes (Qwen)
            "Let me check.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
            '\n<tool_call>{"name": "book_table", "arguments": {"guests": 2, "at": "19:30"}}</tool_call>',
            "Let me check.",
            [("get_weather", {"city": "Oslo", "unit": "c"}), ("book_table", {"guests": 2, "at": "19:30"})],
        ),
        (  # Hermes, cut short after the JSON
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}',
            None,
            [("get_weather", {"city": "Rome", "unit": "f"})],
        ),
        (  # Mistral, marker kept
            '[TOOL_CALLS] [{"name": "book_table", "arguments": {"guests": 4, "at": "12:00"}}]',
            None,
            [("book_table", {"guests": 4, "at": "12:00"})],
        ),
        (  # Mistral, the marker skipped as a special token
            ' [{"name": "get_weather", "arguments": {"city": "Nice", "unit": "c"}}]',
            None,
            [("get_weather", {"city": "Nice", "unit": "c"})],
        ),
        (  # Llama 3.1 JSON
            '{"name": "get_weather", "parameters": {"city": "Lima", "unit": "c"}}',
            None,
            [("get_weather", {"city": "Lima", "unit": "c"})],
        ),
        (  # Llama 3.2: several, with the python tag
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "A", "unit": "c"}}; '
            '{"name": "book_table", "parameters": {"guests": 1, "at": "09:00"}}',
            None,
            [("get_weather", {"city": "A", "unit": "c"}), ("book_table", {"guests": 1, "at": "09:00"})],
        ),
        ('{"name": "launch_rockets", "parameters": {}}', '{"name": "launch_rockets", "parameters": {}}', []),
        ('{"city": "Oslo"}', '{"city": "Oslo"}', []),
        ("The weather is fine.", "The weather is fine.", []),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', None, "unparsed"),
    ],
)
def test_tool_call_parsers(text: str, content, calls) -> None:
    got_content, got_calls = parse_tool_calls(text, NAMES)
    if calls == "unparsed":
        assert (got_content, got_calls) == (text, [])
        return
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


def test_answers_carry_tool_calls_with_ids() -> None:
    tools = ToolRequest([WEATHER], "auto")
    a = answer(
        tools,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "X", "unit": "c"}}</tool_call>',
        "stop",
        lambda k: f"call_{k}",
    )
    assert a.content is None and a.finish_reason == "tool_calls"
    assert a.tool_calls == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "X", "unit": "c"}'},
        }
    ]
    cut = answer(ToolRequest([WEATHER], NAMED, "get_weather"), '{"city":"X', "length", lambda k: "c")
    assert cut.finish_reason == "length" and cut.tool_calls is not None  # a forced call cut short stays a call
    plain = answer(ToolRequest([WEATHER], "none"), "hello", "stop", lambda k: "c")
    assert (plain.content, plain.tool_calls, plain.finish_reason) == ("hello", None, "stop")


# ---- whole jobs -------------------------------------------------------------------------------


def _line(custom_id: str, **body: Any) -> dict[str, Any]:
    body.setdefault("messages", [{"role": "user", "content": f"Answer {custom_id} in JSON"}])
    body.setdefault("max_tokens", 300)
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _job_lines() -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """A batch mixing schemas, tools and bad lines; and the schema each good JSON line must meet."""
    lines, schemas = [], {}
    for i, name in enumerate(sorted(SCHEMAS)):
        sampling = {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i}
        lines.append(_line(f"schema-{name}", response_format=json_schema(SCHEMAS[name], name="s"), **sampling))
        schemas[f"schema-{name}"] = SCHEMAS[name]
    lines.append(_line("n3", response_format=json_schema(SCHEMAS["classification"]), n=3, temperature=1, seed=5))
    schemas["n3"] = SCHEMAS["classification"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    lines.append(_line("tool-named", tools=[WEATHER, BOOK], tool_choice=named))
    lines.append(_line("tool-required", tools=[WEATHER, BOOK], tool_choice="required", temperature=1, seed=2))
    lines.append(_line("tool-one", tools=[WEATHER, BOOK], tool_choice="required", parallel_tool_calls=False))
    lines.append(_line("tool-auto", tools=[WEATHER], tool_choice="auto", max_tokens=8))
    lines.append(
        _line("bad-invalid", response_format=json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}))
    )
    lines.append(_line("bad-keyword", response_format=json_schema({"type": "object", "not": {"required": ["a"]}})))
    lines.append(_line("bad-huge", response_format=json_schema(HUGE)))
    lines.append(_line("bad-choice", structured_outputs={"choice": []}))
    lines.append(_line("choice", structured_outputs={"choice": ["soup", "bread", "cake"]}, temperature=1, seed=1))
    return lines, schemas


def _check_job(results: list[dict[str, Any]], errors: list[dict[str, Any]], schemas: dict[str, Any]) -> None:
    by_id = {r["custom_id"]: r for r in results}
    for custom_id, schema in schemas.items():
        body = by_id[custom_id]["response"]["body"]
        ChatCompletion.model_validate(body)
        for choice in body["choices"]:
            assert choice["finish_reason"] == "stop", (custom_id, choice)
            validate(choice["message"]["content"], schema)
    assert len(by_id["n3"]["response"]["body"]["choices"]) == 3
    for custom_id in ("tool-named", "tool-required", "tool-one"):
        body = by_id[custom_id]["response"]["body"]
        completion = ChatCompletion.model_validate(body)
        (choice,) = completion.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, (custom_id, body)
        calls = choice.message.tool_calls or []
        assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
        for call in calls:
            validate(call.function.arguments, FUNCTIONS[call.function.name])  # type: ignore[union-attr]
        if custom_id == "tool-named":
            assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
        if custom_id == "tool-one":
            assert len(calls) == 1
    auto = ChatCompletion.model_validate(by_id["tool-auto"]["response"]["body"]).choices[0]
    assert auto.message.tool_calls is None and auto.message.content  # garbage text, no call
    assert by_id["choice"]["response"]["body"]["choices"][0]["message"]["content"] in ("soup", "bread", "cake")

    by_error = {e["custom_id"]: e for e in errors}
    assert set(by_error) == {"bad-invalid", "bad-keyword", "bad-huge", "bad-choice"}
    # Refused by the grammar library when the request ran: a 400 on the item.
    for custom_id, words in (("bad-invalid", "Invalid type: strin"), ("bad-keyword", 'Unimplemented keys: ["not"]')):
        error = by_error[custom_id]["response"]["body"]["error"]
        assert by_error[custom_id]["response"]["status_code"] == 400
        assert "cannot compile this JSON schema" in error["message"] and words in error["message"], error
    # Refused at intake: a line error.
    assert by_error["bad-huge"]["error"]["code"] == "invalid_value"
    assert "at most 65536" in by_error["bad-huge"]["error"]["message"]
    assert by_error["bad-choice"]["error"]["param"] == "structured_outputs.choice"


def test_a_structured_job_through_conveyor_run(embedded_stack, env, tmp_path) -> None:
    stack = env(embedded_stack)
    lines, schemas = _job_lines()
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(lines))
    out, err = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    assert main(["run", str(src), "--model", stack.model, "-o", str(out), "--errors", str(err), "-q"]) == 0
    results = [json.loads(x) for x in out.read_text().splitlines()]
    errors = [json.loads(x) for x in err.read_text().splitlines()]
    assert len(results) + len(errors) == len(lines)
    _check_job(results, errors, schemas)


def _example_schemas(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        out[line["custom_id"]] = line["body"]["response_format"]["json_schema"]["schema"]
    return out


def _check_example(results: list[dict[str, Any]]) -> None:
    schemas = _example_schemas(STRUCTURED_EXAMPLE)
    assert [r["custom_id"] for r in results] == list(schemas)
    for r in results:
        body = r["response"]["body"]
        ChatCompletion.model_validate(body)
        validate(body["choices"][0]["message"]["content"], schemas[r["custom_id"]])


def test_the_structured_example_queued_and_in_process(embedded_stack, spawn_worker, env, tmp_path) -> None:
    """examples/structured.jsonl (response_format json_schema) through a worker subprocess on
    embedded defaults (conveyor submit's path) and through conveyor run: every line validates."""
    spawn_worker(embedded_stack)
    client = Client(embedded_stack.settings)
    job = client.submit(STRUCTURED_EXAMPLE, embedded_stack.model)
    job = client.wait(job["id"], timeout=120, poll=0.2)
    assert job["status"] == "completed" and job["request_counts"]["failed"] == 0, job
    _check_example(parse_lines(client.results(job["id"])))
    client.close()

    env(embedded_stack)
    out = tmp_path / "results.jsonl"
    assert main(["run", str(STRUCTURED_EXAMPLE), "--model", embedded_stack.model, "-o", str(out), "-q"]) == 0
    _check_example([json.loads(x) for x in out.read_text().splitlines()])
