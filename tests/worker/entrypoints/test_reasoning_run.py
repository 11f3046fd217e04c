"""Reasoning models and ``/v1/responses`` through ``conveyor run``: a tiny Qwen3-architecture
model whose template opens ``<think>`` in the prompt (DeepSeek-R1, QwQ), every body validated
with the ``openai`` SDK's types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from conveyor.worker.entrypoints.cli import main
from tests.engine.reasoning_models import OPENS_THINK_TEMPLATE, QWEN3_TEMPLATE, build_reasoning_model
from tests.worker.helpers import Stack, jsonl, make_values

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
    },
}
# Each test builds engines and runs tiny models for seconds (tests/markers.py).
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def opens_think(tmp_path_factory) -> str:
    return str(build_reasoning_model(tmp_path_factory.mktemp("r1") / "m", OPENS_THINK_TEMPLATE))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return str(build_reasoning_model(tmp_path_factory.mktemp("q3") / "m", QWEN3_TEMPLATE))


def _run(tmp_path: Path, env, model: str, lines: list[dict[str, Any]], **settings: Any) -> dict[str, dict[str, Any]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    env(Stack(make_values(tmp_path / "home", model, **settings), model))
    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    src.write_bytes(jsonl(lines))
    assert main(["run", str(src), "--model", model, "-o", str(out), "--errors", str(err), "-q"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    rows += [json.loads(x) for x in err.read_text().splitlines()]
    return {r["custom_id"]: r for r in rows}


def _line(custom_id: str, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    body.setdefault("temperature", 0)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _chat(row: dict[str, Any]) -> ChatCompletion:
    assert row["error"] is None and row["response"]["status_code"] == 200, row
    return ChatCompletion.model_validate(row["response"]["body"])


USER = [{"role": "user", "content": "the chef brings soup"}]


def test_thinking_apart_from_the_answer_with_budgets_and_a_schema(tmp_path, env, opens_think) -> None:
    lines = [
        _line("budget", messages=USER, max_tokens=24, thinking_token_budget=4),
        _line("schema", messages=USER, max_tokens=40, thinking_token_budget=3,
              response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}),
        _line("default-budget", messages=USER, max_tokens=24),
    ]  # fmt: skip
    rows = _run(tmp_path, env, opens_think, lines, thinking_token_budget=2)
    budget = _chat(rows["budget"])
    message = budget.choices[0].message
    raw = budget.model_dump()["choices"][0]["message"]
    # Four thinking tokens, then </think> forced: the line answers.
    assert raw["reasoning"] and "</think>" not in raw["reasoning"] and "</think>" not in (message.content or "")
    assert budget.usage is not None and budget.usage.completion_tokens_details is not None
    assert budget.usage.completion_tokens_details.reasoning_tokens == 4
    assert budget.usage.completion_tokens > 5 and message.content  # the answer came after the thinking
    # The worker's default budget (2) applies to a line that names none.
    default = _chat(rows["default-budget"]).usage
    assert default is not None and default.completion_tokens_details is not None
    assert default.completion_tokens_details.reasoning_tokens == 2
    schema = _chat(rows["schema"])
    assert json.loads(schema.choices[0].message.content or "") in ({"ok": True}, {"ok": False})
    assert schema.model_dump()["choices"][0]["message"]["reasoning"]


def test_unclosed_thinking_is_all_reasoning(tmp_path, env, opens_think) -> None:
    rows = _run(
        tmp_path, env, opens_think, [_line("cut", messages=USER, max_tokens=3)], reasoning_field="reasoning_content"
    )
    body = _chat(rows["cut"]).model_dump()
    message = body["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning_content"] and "reasoning" not in message
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3 == body["usage"]["completion_tokens"]


def test_enable_thinking_off_and_effort_refused(tmp_path, env, qwen3) -> None:
    lines = [
        _line("off", messages=USER, max_tokens=4, chat_template_kwargs={"enable_thinking": False}),
        _line("effort", messages=USER, max_tokens=4, reasoning_effort="low"),
        _line("bad-kwargs", messages=USER, max_tokens=4, chat_template_kwargs={"tokenize": True}),
    ]
    rows = _run(tmp_path, env, qwen3, lines)
    off = _chat(rows["off"]).model_dump()
    assert "reasoning" not in off["choices"][0]["message"]
    assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    effort = rows["effort"]
    assert effort["response"]["status_code"] == 400
    assert "reasoning_effort is defined for gpt-oss" in effort["response"]["body"]["error"]["message"]
    assert "set by the engine" in rows["bad-kwargs"]["response"]["body"]["error"]["message"]


def test_tool_conversations_render_through_the_template(tmp_path, env, qwen3) -> None:
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    responses_input = [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    lines = [
        _line("chat", messages=history, tools=[WEATHER], max_tokens=4),
        _line("chat-forced", messages=history, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              max_tokens=80, chat_template_kwargs={"enable_thinking": False}),
    ]  # fmt: skip
    rows = _run(tmp_path, env, qwen3, lines)
    assert _chat(rows["chat"]).choices[0].finish_reason in ("length", "stop")
    forced = _chat(rows["chat-forced"]).choices[0].message
    assert forced.tool_calls and forced.tool_calls[0].type == "function"
    assert forced.tool_calls[0].function.name == "get_weather"
    resp_rows = _run(tmp_path / "r", env, qwen3, [
        _line("resp", "/v1/responses", input=responses_input, tools=[{"type": "function", **WEATHER["function"]}],
              tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
              chat_template_kwargs={"enable_thinking": False}),
    ])  # fmt: skip
    response = Response.model_validate(resp_rows["resp"]["response"]["body"])
    calls = [o for o in response.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")


def test_responses_lines(tmp_path, env, opens_think) -> None:
    lines = [
        _line("plain", "/v1/responses", input="the chef", instructions="be brief", max_output_tokens=20,
              thinking_token_budget=3),
        _line("schema", "/v1/responses", input=[{"role": "user", "content": [{"type": "input_text", "text": "soup"}]}],
              text={"format": {"type": "json_schema", "name": "o", "schema": SCHEMA}}, max_output_tokens=40,
              thinking_token_budget=2),
        _line("cut", "/v1/responses", input="the chef", max_output_tokens=2),
        _line("stored", "/v1/responses", input="x", store=True),
        _line("previous", "/v1/responses", input="x", previous_response_id="resp_1"),
        _line("background", "/v1/responses", input="x", background=True),
        _line("hosted", "/v1/responses", input="x", tools=[{"type": "web_search"}]),
    ]  # fmt: skip
    rows = _run(tmp_path, env, opens_think, lines)
    plain = Response.model_validate(rows["plain"]["response"]["body"])
    assert [o.type for o in plain.output] == ["reasoning", "message"]
    assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens == 3
    assert plain.status == ("incomplete" if plain.usage.output_tokens == 20 else "completed")
    assert plain.instructions == "be brief" and plain.max_output_tokens == 20
    schema = Response.model_validate(rows["schema"]["response"]["body"])
    assert json.loads(schema.output_text) in ({"ok": True}, {"ok": False})
    cut = Response.model_validate(rows["cut"]["response"]["body"])
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    for name, param in (("stored", "store"), ("previous", "previous_response_id"), ("background", "background"),
                        ("hosted", "tools[0]")):  # fmt: skip
        assert rows[name]["error"]["param"] == param, rows[name]
