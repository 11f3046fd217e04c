"""The published chat templates of ``tests/data/checkpoints/<family>/`` (sources in its
``SOURCES.md``), each on our small trained tokenizer (``conveyor.testing.tiny_models``), and the
conversations they are checked on, in the OpenAI form a batch line sends them.

A family with a published ``tokenizer_config.json`` gets its added-token table as published
(content and ``special`` flag); the others get the think and tool markers their template
writes as added tokens, with a ``special`` flag the test chooses, so a parser is checked under
both flags where the published one could not be had."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

CHECKPOINTS = Path(__file__).resolve().parents[2] / "data" / "checkpoints"
TEMPLATE_FAMILIES = sorted(p.parent.name for p in CHECKPOINTS.glob("*/chat_template.jinja"))

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}
SYSTEM = {"role": "system", "content": "You answer briefly."}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
# Nine alphanumerics: Mistral's template refuses any other call id.
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
SUNNY = {"role": "assistant", "content": "Sunny."}
RESULT = {"role": "tool", "tool_call_id": "call12345", "content": '{"temperature": 21}'}

# name -> the chat body's fields besides the model's controls
CONVERSATIONS: dict[str, dict[str, Any]] = {
    "system": {"messages": [SYSTEM, ASK]},
    "multi_turn": {"messages": [SYSTEM, ASK, SUNNY, {"role": "user", "content": "And tomorrow?"}]},
    "tools_offered": {"messages": [SYSTEM, ASK], "tools": [WEATHER]},
    "tool_call_and_result": {
        "messages": [SYSTEM, ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}, RESULT],
        "tools": [WEATHER],
    },
    "reasoning_turn": {
        "messages": [
            ASK,
            {"role": "assistant", "reasoning_content": "They want the weather.", "content": "Sunny."},
            {"role": "user", "content": "Thanks. And tomorrow?"},
        ]
    },
    "reasoning_then_call": {
        "messages": [
            ASK,
            {"role": "assistant", "reasoning_content": "I should ask the tool.", "content": None, "tool_calls": [CALL]},
            RESULT,
        ],
        "tools": [WEATHER],
    },
}


def template_of(family: str) -> str:
    return (CHECKPOINTS / family / "chat_template.jinja").read_text(encoding="utf-8")


def thinking_controls(family: str) -> list[dict[str, Any]]:
    """The chat body fields that turn the family's thinking off and on, as its template names
    them (none when it has no such switch)."""
    template = template_of(family)
    if "reasoning_effort" in template:
        return [{"reasoning_effort": "low"}, {"reasoning_effort": "high"}]
    for name in ("enable_thinking", "thinking"):
        if f"{name} is defined" in template or f"not {name}" in template:
            return [{"chat_template_kwargs": {name: False}}, {"chat_template_kwargs": {name: True}}]
    return []


def published_added_tokens(family: str) -> list[tuple[str, bool]] | None:
    """(content, special) of each added token in the family's published tokenizer_config.json."""
    path = CHECKPOINTS / family / "tokenizer_config.json"
    if not path.is_file():
        return None
    table = json.loads(path.read_text())["added_tokens_decoder"]
    return [(entry["content"], entry["special"]) for _, entry in sorted(table.items(), key=lambda kv: int(kv[0]))]


def template_tokenizer(base: Any, family: str, markers: Sequence[str] = (), special: bool = False) -> Any:
    """A copy of ``base`` (our trained tokenizer) with the family's published template and its
    added tokens: the published table where there is one, else ``markers`` flagged ``special``."""
    tok = copy.deepcopy(base)
    tok.chat_template = template_of(family)
    published = published_added_tokens(family)
    added = published if published is not None else [(m, special) for m in markers]
    for content, is_special in added:
        token = AddedToken(content, special=is_special, normalized=False)
        if is_special:
            tok.add_special_tokens({"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
        else:
            tok.add_tokens([token])
    names = json.loads((CHECKPOINTS / family / "special_tokens_map.json").read_text()) if published else {}
    for role in ("bos_token", "eos_token", "pad_token"):
        if isinstance(names.get(role), str):
            setattr(tok, role, names[role])
    return tok


def as_transformers_messages(
    messages: list[dict[str, Any]], *, text_arguments: bool, empty_content: bool, reasoning_key: str
) -> list:
    """The conversation as transformers documents it for ``apply_chat_template``: call
    arguments as objects (or as the JSON text sent, for a template that takes only text), a
    null content as sent (or empty, for a template that needs a string), the thinking under the
    key the template reads."""
    out = []
    for message in copy.deepcopy(messages):
        if empty_content and message.get("content") is None:
            message["content"] = ""
        if "reasoning_content" in message and reasoning_key != "reasoning_content":
            message[reasoning_key] = message.pop("reasoning_content")
        for call in message.get("tool_calls", []):
            if not text_arguments:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(message)
    return out


def transformers_render(tok: Any, body: dict[str, Any]) -> str:
    """``apply_chat_template`` over ``body`` with the published template: the conversation in
    transformers' form, as sent where the template takes it, else in the first of the forms
    above that it takes."""
    template = tok.chat_template
    reasoning_key = "thinking" if "message.thinking" in template else "reasoning_content"
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if "reasoning_effort" in body:
        kwargs["reasoning_effort"] = body["reasoning_effort"]
    first: Exception | None = None
    for text_arguments, empty_content in ((False, False), (False, True), (True, False), (True, True)):
        messages = as_transformers_messages(
            body["messages"], text_arguments=text_arguments, empty_content=empty_content, reasoning_key=reasoning_key
        )
        try:
            return tok.apply_chat_template(
                messages, tools=body.get("tools"), tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as exc:  # the template refuses this form; try the next
            first = first or exc
    assert first is not None
    raise first
