"""The reasoning parsers on text in each family's published format, the choice of a parser from
the family and template, and the Responses body read as the chat request it amounts to."""

from __future__ import annotations

import json

import pytest

from conveyor.worker.batchio.body_errors import InvalidRequest
from conveyor.worker.batchio.reasoning_parsers import (
    Gemma4Parser,
    HarmonyParser,
    ReasoningParser,
    ReasoningSplit,
    ThinkParser,
    choose_parser,
    parser_named,
)
from conveyor.worker.batchio.responses_body import chat_body
from conveyor.worker.batchio.tool_parsers import parse_tool_calls


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "content"),
    [
        ("<think>\nsoup is hot\n</think>\n\nIt is hot.", False, "soup is hot", "It is hot."),
        ("soup is hot\n</think>\n\nIt is hot.", True, "soup is hot", "It is hot."),  # QwQ / R1: opened in the prompt
        ("soup is hot</think>It is hot.", False, "soup is hot", "It is hot."),  # R1 distills repeat no opener
        ("<think>\nstill thinking", False, "still thinking", ""),  # cut short by max_tokens
        ("still thinking", True, "still thinking", ""),
        ("It is hot.", False, None, "It is hot."),  # no thinking at all
        ("<think>\n\n</think>\n\nIt is hot.", False, None, "It is hot."),  # enable_thinking off, empty block
    ],
)
def test_think_blocks(text: str, opened: bool, reasoning, content: str) -> None:
    assert ThinkParser().split(text, opened_in_prompt=opened) == ReasoningSplit(reasoning, content)


def test_tool_calls_are_read_from_the_answer_only() -> None:
    text = '<think>maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>? no</think>\n\nok'
    split = ThinkParser().split(text)
    assert split.content == "ok" and parse_tool_calls(split.content, ["f"]) == ("ok", [])


def test_harmony_channels() -> None:
    text = (
        "<|channel|>analysis<|message|>User wants weather.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    )
    assert HarmonyParser().split(text) == ReasoningSplit("User wants weather.", "It is sunny.")
    call = (
        "<|channel|>analysis<|message|>Need the tool.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
        "<|call|>"
    )
    split = HarmonyParser().split(call)
    assert split.reasoning == "Need the tool."
    assert parse_tool_calls(split.content, ["get_weather"]) == (None, [("get_weather", '{"city": "Oslo"}')])
    # The recipient in the role header, as gpt-oss also writes it.
    header = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>'
    assert parse_tool_calls(HarmonyParser().split(header).content, ["get_weather"])[1] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    cut = "<|channel|>analysis<|message|>Thinking on and on"
    assert HarmonyParser().split(cut) == ReasoningSplit("Thinking on and on", "")
    assert HarmonyParser().template_kwargs_for_effort("high") == {"reasoning_effort": "high"}


def test_gemma4_thought_channel() -> None:
    parser = Gemma4Parser()
    assert parser.split("<|channel>thought\nThe soup is hot.<channel|>It is hot.<turn|>") == ReasoningSplit(
        "The soup is hot.", "It is hot."
    )
    assert parser.split("It is hot.") == ReasoningSplit(None, "It is hot.")
    assert parser.split("\nhot soup<channel|>Hot.", opened_in_prompt=True) == ReasoningSplit("hot soup", "Hot.")
    assert parser.keeps_special_tokens and parser.opened_in_prompt("<|turn>model\n<|channel>thought\n")


# Gemma 4's chat template (google/gemma-4 ``chat_template.jinja``), verbatim: its argument macro
# and how it writes an assistant turn's tool calls (the rest of the template left out).
GEMMA4_CALLS_TEMPLATE = """
{%- macro format_argument(argument, escape_keys=True) -%}
    {%- if argument is string -%}
        {{- '<|"|>' + argument + '<|"|>' -}}
    {%- elif argument is boolean -%}
        {{- 'true' if argument else 'false' -}}
    {%- elif argument is mapping -%}
        {{- '{' -}}
        {%- set ns = namespace(found_first=false) -%}
        {%- for key, value in argument | dictsort -%}
            {%- if ns.found_first %},{% endif -%}
            {%- set ns.found_first = true -%}
            {%- if escape_keys -%}
                {{- '<|"|>' + key + '<|"|>' -}}
            {%- else -%}
                {{- key -}}
            {%- endif -%}
            :{{- format_argument(value, escape_keys=escape_keys) -}}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif argument is sequence -%}
        {{- '[' -}}
        {%- for item in argument -%}
            {{- format_argument(item, escape_keys=escape_keys) -}}
            {%- if not loop.last %},{% endif -%}
        {%- endfor -%}
        {{- ']' -}}
    {%- else -%}
        {{- argument -}}
    {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
        {{- '<|turn>' + role + '\\n' }}

            {%- if message['tool_calls'] -%}
                {%- for tool_call in message['tool_calls'] -%}
                    {%- set function = tool_call['function'] -%}
                    {{- '<|tool_call>call:' + function['name'] + '{' -}}
                    {%- if function['arguments'] is mapping -%}
                        {%- set ns_args = namespace(found_first=false) -%}
                        {%- for key, value in function['arguments'] | dictsort -%}
                            {%- if ns_args.found_first %},{% endif -%}
                            {%- set ns_args.found_first = true -%}
                            {{- key -}}:{{- format_argument(value, escape_keys=False) -}}
                        {%- endfor -%}
                    {%- elif function['arguments'] is string -%}
                        {{- function['arguments'] -}}
                    {%- endif -%}
                    {{- '}<tool_call|>' -}}
                {%- endfor -%}
            {%- endif -%}
            {%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}
{%- endfor -%}
"""


def test_gemma4_tool_calls_as_its_template_writes_them() -> None:
    """An assistant turn with calls rendered by Gemma 4's own template (strings with quotes,
    commas and colons, numbers, booleans, nested objects and lists), read back as the model
    would write it (stopping at ``<|tool_response>``): the same calls, in order, and the text
    before them as content; a call cut short stays text."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    calls = [
        ("get_weather", {"city": 'Paris, "FR": centre', "days": 3, "metric": True}),
        ("search", {"query": "soup", "filters": {"max_price": 12.5, "tags": ["hot", "vegan"]}, "page": None}),
    ]
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
    }
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    rendered = env.from_string(GEMMA4_CALLS_TEMPLATE).render(messages=[message])
    output = "Let me look." + rendered.removeprefix("<|turn>model\n") + "<|tool_response>"
    assert output.count("<|tool_call>call:") == 2 and '<|"|>' in output
    split = Gemma4Parser().split(output)
    content, found = parse_tool_calls(split.content, ["get_weather", "search"])
    assert content == "Let me look."
    assert [(name, json.loads(args)) for name, args in found] == calls
    thought = "<|channel>thought\nThe user wants weather.<channel|>" + output
    assert Gemma4Parser().split(thought).reasoning == "The user wants weather."
    assert parse_tool_calls(Gemma4Parser().split(thought).content, ["get_weather", "search"])[1] == found
    cut = '<|tool_call>call:get_weather{city:<|"|>Par'
    assert Gemma4Parser().split(cut) == ReasoningSplit(None, cut)


def test_effort_is_refused_where_the_family_has_none() -> None:
    for parser in (ThinkParser(), Gemma4Parser(), ReasoningParser()):
        with pytest.raises(InvalidRequest, match="gpt-oss"):
            parser.template_kwargs_for_effort("low")


@pytest.mark.parametrize(
    ("setting", "model_type", "template", "name"),
    [
        ("auto", "qwen3", "{{ '<think>' }}", "think"),
        ("auto", "llama", "<|im_start|>", "none"),
        ("auto", "gpt_oss", None, "harmony"),
        ("auto", "gemma4", None, "gemma4"),
        ("auto", "qwen2", "...<|channel|>final<|message|>", "harmony"),
        ("none", "qwen3", "<think>", "none"),
        ("deepseek_r1", "llama", None, "think"),
    ],
)
def test_choosing_a_parser(setting: str, model_type: str, template, name: str) -> None:
    assert choose_parser(setting, model_type, template).name == name


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        parser_named("nope")


def test_responses_bodies_as_chat() -> None:
    chat = chat_body(
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
            ],
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "reasoning": {"effort": "low"},
            "store": False,
        }
    )
    assert chat["messages"][0] == {"role": "system", "content": "be brief"}
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert len(chat["messages"][2]["tool_calls"]) == 2  # parallel calls: one assistant turn
    assert chat["max_completion_tokens"] == 9 and chat["reasoning_effort"] == "low"
    assert chat["response_format"]["json_schema"]["name"] == "o"
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "store": True}, "store"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0]"),
        ({"input": "x", "stream": True}, "stream"),
        ({"input": "x", "wat": 1}, "wat"),
        ({"input": [{"type": "input_image"}]}, "input[0]"),
        ({"instructions": "x"}, "input"),
    ],
)
def test_what_responses_refuse(body, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        chat_body(body)
    assert info.value.param == param
