"""Tool calls read out of a model's free text (``tool_choice: auto``), in the syntaxes of the
families Conveyor serves:

- Hermes style, which Qwen2/Qwen2.5/Qwen3 chat templates teach:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after optional text;
- Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (the marker is a special
  token, so it is usually gone from the decoded text: the bare array is read too);
- Llama 3.1/3.2 JSON: the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``, several separated by ``;``).

Only calls naming one of the request's functions count, and a text that is not wholly such
calls (outside Hermes tags) is content, not calls: a model merely talking about JSON keeps its
text.
"""

from __future__ import annotations

import json
import re
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"

Call = tuple[str, str]  # (function name, arguments as JSON text)


def parse_tool_calls(text: str, names: list[str]) -> tuple[str | None, list[Call]]:
    """``(content, calls)``: the text left as the message's content (None when there is none)
    and the calls found, in order. No calls: ``(text, [])``."""
    allowed = set(names)
    if "<tool_call>" in text:
        calls = []
        for body in _HERMES.findall(text):
            call = _call(_loads(body), allowed)
            if call is None:
                return text, []
            calls.append(call)
        content = text[: text.index("<tool_call>")].strip()
        return content or None, calls
    head = text.strip()
    if head.startswith(_MISTRAL):
        head = head[len(_MISTRAL) :].strip()
    if head.startswith(_PYTHON_TAG):
        head = head[len(_PYTHON_TAG) :].strip()
    if not head.startswith(("{", "[")):
        return text, []
    values = _json_values(head)
    if values is None:
        return text, []
    calls = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            call = _call(item, allowed)
            if call is None:
                return text, []
            calls.append(call)
    return (None, calls) if calls else (text, [])


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_values(text: str) -> list[Any] | None:
    """One JSON value, or several separated by ``;`` (Llama 3.2), or None."""
    value = _loads(text)
    if value is not None:
        return [value]
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return values


def _call(item: Any, allowed: set[str]) -> Call | None:
    if not isinstance(item, dict) or item.get("name") not in allowed:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        parsed = _loads(args)
        args = parsed if isinstance(parsed, dict) else None
    if not isinstance(args, dict):
        return None
    return item["name"], json.dumps(args, ensure_ascii=False)
