"""``/v1/messages`` as a batch endpoint: an Anthropic Messages request (a Message Batch's
``params``) read as the chat request it amounts to.

In: ``model``, ``max_tokens`` (required), ``system`` (a string or text blocks), ``messages``
whose content is a string or blocks: ``text``, ``tool_use`` (an assistant's call),
``tool_result`` (a string or text blocks; ``is_error`` puts ``Error: `` in front of the text,
as chat has no such flag), and ``thinking``/``redacted_thinking`` in the history (dropped, as
chat templates drop past thinking). ``tools`` (``name``, ``description``, ``input_schema``),
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``; ``disable_parallel_tool_use``),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``metadata`` (accepted),
``thinking`` (``enabled`` with ``budget_tokens``: the thinking token budget of a reasoning
model; ``disabled``: a budget of 0; ``adaptive``: no budget), ``output_config`` (``format``: a
JSON Schema the answer is decoded under; ``effort`` ``low``, ``medium`` or ``high``: a reasoning
model's effort). ``cache_control``, on any block or the request, is accepted and ignored: the
prefix cache works without being asked; so are ``inference_geo`` and ``speed``.

Refused with a reason, as that request's error: ``stream: true``, images, documents and other
blocks we cannot serve, server tools (web search, code execution...), ``container``,
``mcp_servers``, and any parameter we do not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from conveyor.worker.batchio.body_errors import InvalidRequest, shown

MESSAGES = "/v1/messages"

# Read below into the chat body; anything else is refused by name.
_READ = (
    "model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature",
    "top_p", "top_k", "metadata", "thinking", "stream", "service_tier", "output_config", "cache_control",
    "inference_geo", "speed",
)  # fmt: skip
_EFFORTS = ("low", "medium", "high")  # ours; Anthropic's xhigh and max have no counterpart
_REFUSED = {
    "container": "containers belong to server tools, which a batch line does not run",
    "mcp_servers": "MCP servers are not supported: a batch line can only return tool calls for you to run",
}
_CACHE = "cache_control"  # accepted on any block and ignored


def chat_body(params: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body an Anthropic ``params`` object amounts to (``InvalidRequest``
    naming the field that cannot be served)."""
    _check_params(params)
    max_tokens = params["max_tokens"]
    chat: dict[str, Any] = {"max_tokens": max_tokens}
    if params.get("model") is not None:
        chat["model"] = params["model"]
    chat["messages"] = _system(params.get("system")) + _messages(params.get("messages"))
    chat.update(_sampling(params))
    if params.get("thinking") is not None:
        budget = _thinking(params["thinking"], max_tokens)
        if budget is not None:
            chat["thinking_token_budget"] = budget
    if params.get("output_config") is not None:
        chat.update(_output_config(params["output_config"]))
    if params.get("tools") is not None:
        chat["tools"] = _tools(params["tools"])
    if params.get("tool_choice") is not None:
        chat.update(_tool_choice(params["tool_choice"]))
    return chat


def _check_params(params: Mapping[str, Any]) -> None:
    """Every field is one Conveyor reads, ``max_tokens`` is given, and nothing asks for what a
    batch line cannot do."""
    for name in params:
        if name in _REFUSED:
            raise InvalidRequest("unsupported", f"{name}: {_REFUSED[name]}", name)
        if name not in _READ:
            raise InvalidRequest("unknown_parameter", f"{name}: Extra inputs are not permitted", name)
    if params.get("max_tokens") is None:
        raise InvalidRequest("missing_required_parameter", "max_tokens: Field required", "max_tokens")
    if params.get("stream") not in (None, False):
        raise InvalidRequest("unsupported", "stream: batch requests cannot stream", "stream")
    if params.get("service_tier") not in (None, "auto", "standard_only"):
        raise InvalidRequest("invalid_value", f"service_tier: unsupported value {shown(params['service_tier'])}")
    metadata = params.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequest("invalid_value", "metadata: must be an object", "metadata")


def _sampling(params: Mapping[str, Any]) -> dict[str, Any]:
    """``temperature`` (0 to 1 in Anthropic's API), ``top_p``, ``top_k`` and ``stop_sequences``
    under their chat names."""
    chat: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if params.get(theirs) is not None:
            chat[ours] = params[theirs]
    if params.get("temperature") is not None and not _number_in(params["temperature"], 0.0, 1.0):
        raise InvalidRequest("invalid_value", "temperature: must be a number from 0 to 1", "temperature")
    stops = params.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidRequest(
                "invalid_value", "stop_sequences: must be a list of non-empty strings", "stop_sequences"
            )
        if stops:
            chat["stop"] = stops
    return chat


def _number_in(value: Any, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    if not isinstance(value, list):
        raise InvalidRequest("invalid_value", "system: must be a string or a list of text blocks", "system")
    return [{"role": "system", "content": _text_parts("system", value)}] if value else []


def _text_parts(where: str, blocks: list[Any]) -> list[dict[str, Any]]:
    parts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise _unservable(f"{where}[{j}]", kind)
        _only(f"{where}[{j}]", block, {"type", "text", _CACHE, "citations"})
        if not isinstance(block.get("text"), str):
            raise InvalidRequest("invalid_value", f"{where}[{j}].text: must be a string", f"{where}[{j}].text")
        parts.append({"type": "text", "text": block["text"]})
    return parts


def _unservable(where: str, kind: Any) -> InvalidRequest:
    if kind in ("image", "document", "search_result", "container_upload"):
        what = f"{kind} blocks are not supported (Conveyor serves text models)"
    else:
        what = f"blocks of type {shown(kind)} are not supported here"
    return InvalidRequest("unsupported", f"{where}: {what}", where)


def _only(where: str, block: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(block) - allowed)
    if extra:
        raise InvalidRequest("unknown_parameter", f"{where}.{extra[0]}: Extra inputs are not permitted", where)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("invalid_value", "messages: must be a non-empty list of messages", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            what = 'must be "user" or "assistant" (the system prompt goes in system)'
            raise InvalidRequest("invalid_value", f"{where}.role: {what}", where)
        _only(where, msg, {"role", "content"})
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": content})
        elif isinstance(content, list):
            out.extend((_assistant if msg["role"] == "assistant" else _user)(f"{where}.content", content))
        else:
            raise InvalidRequest("invalid_value", f"{where}.content: must be a string or a list of blocks", where)
    return out


def _assistant(where: str, blocks: list[Any]) -> list[dict[str, Any]]:
    """One assistant turn: its text and its calls (past thinking is dropped)."""
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{j}]"
        if kind == "text":
            texts.extend(_text_parts(where, [block]))
        elif kind == "tool_use":
            _only(at, block, {"type", "id", "name", "input", _CACHE, "caller"})
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise InvalidRequest("invalid_value", f"{at}: a tool_use block needs a string id and name", at)
            if not isinstance(block.get("input"), dict):
                raise InvalidRequest("invalid_value", f"{at}.input: must be an object", f"{at}.input")
            fn = {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}
            calls.append({"id": block["id"], "type": "function", "function": fn})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _unservable(at, kind)
    message: dict[str, Any] = {"role": "assistant", "content": texts or ("" if not calls else None)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user(where: str, blocks: list[Any]) -> list[dict[str, Any]]:
    """One user turn: a ``tool`` message per tool result, then its text (if any)."""
    out: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{j}]"
        if kind == "text":
            texts.extend(_text_parts(where, [block]))
        elif kind == "tool_result":
            _only(at, block, {"type", "tool_use_id", "content", "is_error", _CACHE})
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequest("invalid_value", f"{at}.tool_use_id: must be a string", f"{at}.tool_use_id")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _result(at, block)})
        else:
            raise _unservable(at, kind)
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _result(where: str, block: Mapping[str, Any]) -> str:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(p["text"] for p in _text_parts(f"{where}.content", content))
    else:
        raise InvalidRequest("invalid_value", f"{where}.content: must be a string or text blocks", where)
    if block.get("is_error") not in (None, False, True):
        raise InvalidRequest("invalid_value", f"{where}.is_error: must be true or false", f"{where}.is_error")
    return f"Error: {text}" if block.get("is_error") else text


def _thinking(value: Any, max_tokens: Any) -> int | None:
    """The thinking budget (None: the model thinks as it will)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise InvalidRequest("invalid_value", 'thinking.type: must be "enabled", "adaptive" or "disabled"', "thinking")
    _only("thinking", value, {"type", "budget_tokens", "display"})
    if kind != "enabled":
        return 0 if kind == "disabled" else None
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidRequest("invalid_value", "thinking.budget_tokens: must be a positive integer", "thinking")
    if isinstance(max_tokens, int) and budget >= max_tokens:
        raise InvalidRequest(
            "invalid_value", "max_tokens: must be greater than thinking.budget_tokens", "thinking.budget_tokens"
        )
    return budget


def _output_config(value: Any) -> dict[str, Any]:
    """``format`` (a JSON Schema the answer follows) and ``effort`` (a reasoning model's)."""
    if not isinstance(value, dict):
        raise InvalidRequest("invalid_value", "output_config: must be an object", "output_config")
    _only("output_config", value, {"format", "effort"})
    out: dict[str, Any] = {}
    fmt = value.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest(
                "invalid_value", 'output_config.format: must be {"type": "json_schema", "schema": {...}}',
                "output_config.format",
            )  # fmt: skip
        _only("output_config.format", fmt, {"type", "schema"})
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = value.get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise InvalidRequest(
                "unsupported", f"output_config.effort: {shown(effort)} is not served; use low, medium or high",
                "output_config.effort",
            )  # fmt: skip
        out["reasoning_effort"] = effort
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("invalid_value", "tools: must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(
                "unsupported", f"{at}: server tools ({shown(kind)}) are not supported; a batch line can only return "
                "tool calls for you to run", at,
            )  # fmt: skip
        _only(at, tool, {"type", "name", "description", "input_schema", _CACHE, "strict"})
        if "input_schema" not in tool:
            raise InvalidRequest("missing_required_parameter", f"{at}.input_schema: Field required", at)
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequest(
            "invalid_value", 'tool_choice.type: must be "auto", "any", "tool" or "none"', "tool_choice"
        )
    _only("tool_choice", choice, {"type", "name", "disable_parallel_tool_use"})
    out: dict[str, Any] = {}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequest("invalid_value", "tool_choice.name: required with type tool", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise InvalidRequest("invalid_value", "tool_choice.disable_parallel_tool_use: must be true or false")
        out["parallel_tool_calls"] = not parallel
    return out
