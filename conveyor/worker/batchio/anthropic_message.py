"""The Anthropic ``Message`` of one finished ``/v1/messages`` line, written by the worker as the
line's response body (as ``/v1/responses`` lines get their ``response`` object).

Content blocks, in order: ``thinking`` (a reasoning model's thinking; ``signature`` is an empty
string: there is nothing to verify it against), ``text`` (the answer, when there is one or
nothing else), ``tool_use`` (each call: a ``toolu_`` id, ``input`` the parsed arguments; a call
whose arguments are not a JSON object, cut short by ``max_tokens`` say, is kept as text). ``stop_reason`` is
``tool_use``, ``max_tokens``, ``stop_sequence`` (with the sequence in ``stop_sequence``) or
``end_turn``. ``usage.input_tokens`` counts the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those that were (Anthropic's split); nothing is ever written to a
cache on request, so ``cache_creation_input_tokens`` is 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MessageOutput:
    """What the engine made of one request, as the ``Message`` needs it."""

    message_id: str
    model: str
    text: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] | None  # OpenAI's shape: {"id", "function": {"name", "arguments"}}
    finish_reason: str | None  # stop, length or tool_calls
    stop_reason: str | int | None  # the stop string matched, if one was
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def message_object(out: MessageOutput, stop_sequences: Sequence[str] = ()) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    texts = [out.text] if out.text else []
    uses = []
    for call in out.tool_calls or []:
        arguments = call["function"]["arguments"]
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            value = None
        if isinstance(value, dict):
            call_id = "toolu_" + call["id"].removeprefix("call_")  # Anthropic's prefix, the same stable id
            uses.append({"type": "tool_use", "id": call_id, "name": call["function"]["name"], "input": value})
        else:
            texts.append(arguments)
    if texts or not uses:
        content.append({"type": "text", "text": "".join(texts)})
    content.extend(uses)
    stop_reason, stop_sequence = "end_turn", None
    if out.finish_reason == "length":
        stop_reason = "max_tokens"
    elif uses:
        stop_reason = "tool_use"
    elif isinstance(out.stop_reason, str) and out.stop_reason in stop_sequences:
        stop_reason, stop_sequence = "stop_sequence", out.stop_reason
    return {
        "id": out.message_id,
        "type": "message",
        "role": "assistant",
        "model": out.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": out.prompt_tokens - out.cached_tokens,
            "output_tokens": out.output_tokens,
            "cache_read_input_tokens": out.cached_tokens,
            "cache_creation_input_tokens": 0,
        },
    }
