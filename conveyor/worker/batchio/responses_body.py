"""``/v1/responses`` as a batch endpoint (stateless): a Responses request read as the chat request
it amounts to, and the ``response`` object written back.

In: ``input`` (a string, or items: messages with ``input_text``/``output_text`` parts,
``function_call`` and ``function_call_output`` items of a tool conversation; past ``reasoning``
items are dropped, as templates drop past thinking), ``instructions`` (a system message in
front), ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (``text``,
``json_schema``, ``json_object``), function ``tools`` (flat, Responses-style) with
``tool_choice`` and ``parallel_tool_calls``, ``reasoning.effort``; Conveyor's extensions as on
chat (``seed``, ``thinking_token_budget``, ``chat_template_kwargs``...). Refused with a reason:
``previous_response_id`` and ``conversation`` (a batch line has no stored state), ``store:
true``, ``background: true``, hosted tools (web search, file search, code interpreter...),
``prompt`` templates, ``stream``.

Out: a ``response`` object: ``output`` items ``reasoning`` (the thinking as
``reasoning_text``), ``message`` (``output_text``) and ``function_call``, and ``usage`` with
``output_tokens_details.reasoning_tokens``; it validates as ``openai.types.responses.Response``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.worker.batchio.body_errors import InvalidRequest, shown

RESPONSES = "/v1/responses"

_REFUSED = {
    "previous_response_id": "previous_response_id needs stored responses; a batch line is stateless: send the "
    "whole conversation in input",
    "conversation": "conversations need stored state; a batch line is stateless: send the whole conversation in input",
    "prompt": "stored prompt templates are not supported; send the text in input and instructions",
    "max_tool_calls": "max_tool_calls limits hosted tool loops, which a batch line does not run",
}
# Accepted when harmless (None always counts as absent).
_HARMLESS = {
    "model": lambda v: isinstance(v, str),
    "user": lambda v: isinstance(v, str),
    "metadata": lambda v: isinstance(v, dict),
    "safety_identifier": lambda v: isinstance(v, str),
    "prompt_cache_key": lambda v: isinstance(v, str),
    "service_tier": lambda v: isinstance(v, str),
    "truncation": lambda v: v == "disabled",
    "include": lambda v: isinstance(v, list) and not v,
}
# Passed to the chat reading unchanged (Conveyor's chat extensions, as vLLM's Responses takes them).
_PASSED = (
    "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "stop", "thinking_token_budget", "chat_template_kwargs", "parallel_tool_calls",
)  # fmt: skip


# Fields that ask for nothing but must say so: ``false`` (or left out), with why otherwise.
_MUST_BE_FALSE = {
    "store": "store: true keeps responses for later retrieval; batch results are the output file: send store: "
    "false or leave it out",
    "background": "background: true is for single responses; a batch line already runs in the background",
    "stream": "batch requests cannot stream",
}
# Read after the options, by ``chat_body`` itself.
_READ_BY_NAME = ("input", "instructions", "max_output_tokens", "text", "tools", "tool_choice")


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses body amounts to (``InvalidRequest`` naming the
    field that cannot be served)."""
    chat: dict[str, Any] = {}
    for name, value in body.items():
        if value is not None and name not in _READ_BY_NAME:
            chat.update(_option(name, value))
    if "input" not in body or body["input"] is None:
        raise InvalidRequest("missing_prompt", "a responses request needs input", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("invalid_value", "instructions must be a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat["messages"] = system + _messages(body["input"])
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("text") is not None:
        fmt = _text_format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return chat


def _option(name: str, value: Any) -> dict[str, Any]:
    """What one option of a Responses body adds to the chat body (often nothing: it is checked)."""
    if name in _REFUSED:
        raise InvalidRequest("unsupported", _REFUSED[name], name)
    if name in _MUST_BE_FALSE:
        if value is not False:
            raise InvalidRequest("unsupported", _MUST_BE_FALSE[name], name)
        return {}
    if name == "reasoning":
        return _reasoning(value)
    if name in _PASSED:
        return {name: value}
    if name not in _HARMLESS:
        raise InvalidRequest("unknown_parameter", f"unknown parameter {name!r} for {RESPONSES}", name)
    if not _HARMLESS[name](value):
        raise InvalidRequest("unsupported", f"unsupported value for {name} ({shown(value)})", name)
    return {}


def _reasoning(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
        raise InvalidRequest("invalid_value", f'reasoning must be {{"effort": ...}}, got {shown(value)}', "reasoning")
    if value.get("summary") not in (None, "auto", "concise", "detailed") or value.get("generate_summary"):
        raise InvalidRequest("invalid_value", f"reasoning.summary: unsupported value {shown(value)}", "reasoning")
    return {"reasoning_effort": value["effort"]} if value.get("effort") is not None else {}


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("invalid_value", "input is empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("invalid_value", "input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("invalid_value", f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _parts(where, item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls are one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _parts(where, output)})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest("unsupported", f"{where}: items of type {shown(kind)} are not supported", where)
    return out


def _parts(where: str, content: Any) -> Any:
    """Responses' content parts as chat's text parts."""
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequest(
                "unsupported", f"{where}.content[{j}]: only text parts are supported, got type {shown(kind)}", where
            )
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _text_format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InvalidRequest("invalid_value", f'text must be {{"format": {{...}}}}, got {shown(text)}', "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest("invalid_value", "text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequest(
        "invalid_value", f'text.format.type must be "text", "json_schema" or "json_object", got {shown(kind)}',
        "text.format.type",
    )  # fmt: skip


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("invalid_value", "tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(
                "unsupported", f"tools[{i}]: hosted tools ({shown(kind)}) are not supported; a batch line can only "
                "return function calls for you to run", f"tools[{i}]",
            )  # fmt: skip
        fn = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") == "function" and set(choice) == {"type", "name"}:
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequest(
            "unsupported", f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}, '
            f"got {shown(choice)}", "tool_choice",
        )  # fmt: skip
    return choice


# ---- the response object ------------------------------------------------------------------------


def response_object(
    *,
    response_id: str,
    model: str,
    created: int,
    body: Mapping[str, Any],
    reasoning: str | None,
    text: str | None,
    tool_calls: list[dict[str, Any]] | None,
    finish_reason: str | None,
    input_tokens: int,
    output_tokens: int,
    reasoning_tokens: int,
    cached_tokens: int,
    item_id: Any,
) -> dict[str, Any]:
    """The ``response`` object of one finished line (``item_id(kind, k)`` names its items,
    deterministically: a redelivered shard writes the same lines)."""
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(
            {
                "type": "reasoning",
                "id": item_id("rs_", 0),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": "completed",
            }
        )
    incomplete = finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    if text:
        output.append(
            {
                "type": "message",
                "id": item_id("msg_", 0),
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
            }
        )
    for k, call in enumerate(tool_calls or []):
        output.append(
            {
                "type": "function_call",
                "id": item_id("fc_", k),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    text_config = body.get("text") if isinstance(body.get("text"), dict) else None
    reasoning_config = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "completed_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [{"strict": None, "parameters": None, **t} for t in body.get("tools") or []],
        "text": text_config or {"format": {"type": "text"}},
        "reasoning": {"effort": (reasoning_config or {}).get("effort"), "summary": None},
        "store": False,
        "background": False,
        "previous_response_id": None,
        "truncation": "disabled",
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens,
        },
    }
