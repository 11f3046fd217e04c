"""Anthropic Messages requests read as chat requests, and chat results written as ``Message``s.

A translated conversation (system blocks, several turns, a tool call and its result, past
thinking) must reach the chat template exactly as its OpenAI-shaped equivalent does; the
results validate as the ``anthropic`` SDK's ``Message``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from anthropic.types import Message
from transformers import AutoTokenizer

from conveyor.worker.batchio.anthropic_batch_body import BatchBodyError, iter_batch_requests
from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.batchio.anthropic_message import MessageOutput, message_object
from conveyor.worker.batchio.records import record_from_object
from conveyor.worker.batchio.request_body import CHAT
from conveyor.worker.execution.item_records import engine_prompt
from tests.engine.reasoning_models import build_reasoning_model
from tests.worker.helpers import as_line_error, as_request
from tests.worker.lines import LIMITS

LIMITS_FOR_TOOLS = dataclasses.replace(LIMITS, max_line_bytes=64 * 1024)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

ANTHROPIC = {
    "model": "tiny-chat",
    "max_tokens": 64,
    "system": [
        {"type": "text", "text": "You answer briefly."},
        {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C, sunny"}]},
            {"type": "text", "text": "And tomorrow?"},
        ]},
        {"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
        ]},
    ],
    "tools": [{"name": "weather", "description": "Current weather", "input_schema": WEATHER_SCHEMA}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "stop_sequences": ["\n\nHuman:"],
    "temperature": 0.5,
    "top_k": 20,
    "metadata": {"user_id": "u-1"},
    "thinking": {"type": "enabled", "budget_tokens": 32},
}  # fmt: skip

OPENAI = {
    "model": "tiny-chat",
    "max_tokens": 64,
    "messages": [
        {"role": "system", "content": "You answer briefly.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C, sunny"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
    ],
    "tools": [{"type": "function", "function": {
        "name": "weather", "description": "Current weather", "parameters": WEATHER_SCHEMA}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "stop": ["\n\nHuman:"],
    "temperature": 0.5,
    "top_k": 20,
    "thinking_token_budget": 32,
}  # fmt: skip


def _line(url: str, body: dict[str, Any], custom_id: str = "r1") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Any:
    return AutoTokenizer.from_pretrained(str(build_reasoning_model(tmp_path_factory.mktemp("q") / "m")))


def test_a_translated_conversation_renders_as_its_openai_equivalent(tokenizer) -> None:
    ours = as_request(record_from_object(_line(MESSAGES, ANTHROPIC), 1, LIMITS_FOR_TOOLS))
    theirs = as_request(record_from_object(_line(CHAT, OPENAI), 1, LIMITS_FOR_TOOLS))
    assert ours.endpoint == MESSAGES and ours.echoed == {"stop_sequences": ["\n\nHuman:"]}
    assert (ours.messages, ours.tools, ours.sampling) == (theirs.messages, theirs.tools, theirs.sampling)
    assert ours.sampling["thinking_token_budget"] == 32 and ours.tools is not None and not ours.tools.parallel

    def rendered(prompt: dict[str, Any]) -> str:
        text = tokenizer.apply_chat_template(
            prompt["messages"], tools=prompt.get("tools"), tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)
        return text

    text = rendered(engine_prompt(ours))
    assert text == rendered(engine_prompt(theirs))
    assert "You answer briefly.\nUse tools." in text and "<tool_response>\nError: timeout\n</tool_response>" in text
    assert '"arguments": {"city": "Paris"}' in text and "I should call the tool." not in text  # past thinking dropped


def test_output_config_and_adaptive_thinking_read_as_their_chat_fields() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    base = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    ours = as_request(record_from_object(_line(MESSAGES, {
        **base, "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        "thinking": {"type": "adaptive", "display": "summarized"}, "cache_control": {"type": "ephemeral"},
        "speed": "fast",
    }), 1, LIMITS))  # fmt: skip
    theirs = as_request(record_from_object(_line(CHAT, {
        **base, "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}},
        "reasoning_effort": "low",
    }), 1, LIMITS))  # fmt: skip
    assert ours.sampling == theirs.sampling and "thinking_token_budget" not in ours.sampling
    assert ours.sampling["structured_outputs"] is not None and ours.reasoning_effort == theirs.reasoning_effort == "low"


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]",
         "image blocks are not supported"),
        ({"stream": True}, "stream", "cannot stream"),
        ({"top_logprobs": 3}, "top_logprobs", "Extra inputs are not permitted"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]", "server tools"),
        ({"max_tokens": None}, "max_tokens", "Field required"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]", "goes in system"),
        ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking.budget_tokens", "greater than thinking"),
        ({"container": "c1"}, "container", "server tools"),
        ({"output_config": {"effort": "max"}}, "output_config.effort", "use low, medium or high"),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format", "json_schema"),
        ({"thinking": {"type": "sometimes"}}, "thinking", '"enabled", "adaptive" or "disabled"'),
    ],
)  # fmt: skip
def test_a_request_we_cannot_serve_is_that_lines_error_naming_the_field(params, param, words) -> None:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **params}
    error = as_line_error(record_from_object(_line(MESSAGES, body), 3, LIMITS))
    assert (error.param, error.custom_id, error.line) == (param, "r1", 3), error
    assert words in error.message, error.message


def _out(**kw: Any) -> MessageOutput:
    base: dict[str, Any] = dict(
        message_id="msg_1", model="tiny-chat", text="Hello", reasoning=None, tool_calls=None, finish_reason="stop",
        stop_reason=None, prompt_tokens=10, cached_tokens=4, output_tokens=3,
    )  # fmt: skip
    return MessageOutput(**{**base, **kw})


def test_results_are_sdk_messages_with_anthropics_stop_reasons_and_usage() -> None:
    plain = Message.model_validate(message_object(_out()))
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason == "end_turn"
    assert (plain.usage.input_tokens, plain.usage.cache_read_input_tokens, plain.usage.output_tokens) == (6, 4, 3)
    assert plain.usage.cache_creation_input_tokens == 0 and plain.role == "assistant" and plain.id == "msg_1"

    stopped = Message.model_validate(message_object(_out(stop_reason="\n\nHuman:"), ["\n\nHuman:"]))
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "\n\nHuman:")
    assert Message.model_validate(message_object(_out(finish_reason="length"))).stop_reason == "max_tokens"

    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    used = Message.model_validate(
        message_object(_out(text="", reasoning="think", tool_calls=[call], finish_reason="tool_calls"))
    )
    assert [b.type for b in used.content] == ["thinking", "tool_use"] and used.stop_reason == "tool_use"
    thinking, tool_use = used.content
    assert thinking.type == "thinking" and (thinking.thinking, thinking.signature) == ("think", "")
    assert tool_use.type == "tool_use" and tool_use.input == {"city": "Oslo"}
    assert (tool_use.id, tool_use.name) == ("toolu_1", "weather")

    cut = {**call, "function": {"name": "weather", "arguments": '{"city": "Os'}}
    truncated = Message.model_validate(message_object(_out(text="", tool_calls=[cut], finish_reason="length")))
    assert [(b.type, getattr(b, "text", None)) for b in truncated.content] == [("text", '{"city": "Os')]
    assert truncated.stop_reason == "max_tokens"


def _requests(body: str, max_requests: int = 10) -> list[Any]:
    return list(iter_batch_requests(body, max_requests))


def test_the_batch_body_is_read_request_by_request() -> None:
    reqs = _requests('{"requests": [{"custom_id": "a-1", "params": {"x": 1}}, {"params": {}, "custom_id": "B_2"}]}')
    assert [(r.index, r.custom_id, r.params) for r in reqs] == [(0, "a-1", {"x": 1}), (1, "B_2", {})]
    (huge,) = _requests('{"requests": [{"custom_id": "a", "params": {"max_tokens": ' + "9" * 5000 + "}}]}")
    assert len(str(huge.params["max_tokens"])) == 101  # refused by intake by name, not here


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ('{"requests": [{"custom_id": "a b", "params": {}}]}', "requests.0.custom_id", "1 to 64 characters"),
        ('{"requests": [{"custom_id": "' + "x" * 65 + '", "params": {}}]}', "requests.0.custom_id", "1 to 64"),
        ('{"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}]}', "requests.1.custom_id",
         "unique"),
        ('{"requests": [{"custom_id": "a", "params": {}, "x": 1}]}', "requests.0.x", "Extra inputs"),
        ('{"requests": [{"custom_id": "a", "params": []}]}', "requests.0.params", "must be an object"),
        ('{"requests": []}', "requests", "at least one"),
        ('{"batch": []}', "batch", "Extra inputs"),
        ('{"requests": [' + ",".join(f'{{"custom_id": "c{i}", "params": {{}}}}' for i in range(4)) + "]}", "requests",
         "at most 3"),
        ('{"requests": [{"custom_id": "a", "params": {}}', None, "not valid JSON"),
        ('{"requests": [{"custom_id": "a", "params": {}}]} x', None, "extra data"),
    ],
)  # fmt: skip
def test_a_batch_anthropic_would_refuse_is_refused_whole(body: str, param: str | None, words: str) -> None:
    with pytest.raises(BatchBodyError) as caught:
        _requests(body, max_requests=3)
    assert caught.value.param == param and words in caught.value.message, caught.value.message
