"""Tool calls read out of a model's free text (``tool_choice: auto``), in the syntaxes of the
families Conveyor serves:

- Hermes style, which Qwen2/Qwen2.5/Qwen3 chat templates teach:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, with text around
  them;
- Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (the marker is a special
  token, so it is usually gone from the decoded text: the bare array is read too);
- Llama 3.1/3.2 JSON: the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``, several separated by ``;``);
- Qwen3.5's and GLM-4.5's XML inside ``<tool_call>`` (``xml_tool_calls``);
- DeepSeek-V3.1: its tool-calls-begin token, then per call the call-begin token, the name, the
  separator token, the arguments' JSON and the call-end token, then the tool-calls-end token
  (full-width bars in those tokens), after optional text.

Only calls naming one of the request's functions count, and a text that is not wholly such
calls (outside Hermes tags) is content, not calls: a model merely talking about JSON keeps its
text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from conveyor.worker.batchio.xml_tool_calls import xml_call

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"
# The markers these syntaxes read: where a tokenizer makes one a special token, the worker
# keeps it in the decoded text (``execution.reasoning``).
_DEEPSEEK_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_DEEPSEEK_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
_DEEPSEEK_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
_DEEPSEEK_SEP = "<\uff5ctool\u2581sep\uff5c>"
_DEEPSEEK_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
_DEEPSEEK_CALL = re.compile(
    re.escape(_DEEPSEEK_CALL_BEGIN) + r"(.*?)" + re.escape(_DEEPSEEK_SEP) + r"(.*?)" + re.escape(_DEEPSEEK_CALL_END),
    re.DOTALL,
)
MARKERS = (
    "<tool_call>", "</tool_call>", _MISTRAL, _PYTHON_TAG,
    _DEEPSEEK_BEGIN, _DEEPSEEK_END, _DEEPSEEK_CALL_BEGIN, _DEEPSEEK_SEP, _DEEPSEEK_CALL_END,
)  # fmt: skip

Call = tuple[str, str]  # (function name, arguments as JSON text)


def parse_tool_calls(
    text: str, names: list[str], schemas: Mapping[str, Any] | None = None
) -> tuple[str | None, list[Call]]:
    """``(content, calls)``: the text left as the message's content (None when there is none)
    and the calls found, in order. No calls: ``(text, [])``. ``schemas``: each function's
    parameters schema, which types the values of XML calls."""
    allowed = set(names)
    if _DEEPSEEK_BEGIN in text:
        return _deepseek(text, allowed)
    if "<tool_call>" in text:
        return _hermes(text, allowed, schemas or {})
    return _json_calls(text, allowed)


def _hermes(text: str, allowed: set[str], schemas: Mapping[str, Any]) -> tuple[str | None, list[Call]]:
    """Calls in ``<tool_call>`` tags, each a JSON object or an XML call (Qwen3-Coder's)."""
    calls = []
    for body in _HERMES.findall(text):
        if body.startswith("{"):
            call = _call(_loads(body), allowed)
        else:
            xml = xml_call(body, schemas)
            call = _call({"name": xml[0], "arguments": xml[1]}, allowed) if xml is not None else None
        if call is None:
            return text, []
        calls.append(call)
    # The text around the calls: Gemma 4's template writes a turn's answer after them.
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def _json_calls(text: str, allowed: set[str]) -> tuple[str | None, list[Call]]:
    """Calls as bare JSON, after Mistral's or Llama's marker when there is one: the whole text
    is calls, or it is the content."""
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


def _deepseek(text: str, allowed: set[str]) -> tuple[str | None, list[Call]]:
    head, _, tail = text.partition(_DEEPSEEK_BEGIN)
    body = tail.split(_DEEPSEEK_END, 1)[0]
    calls = []
    for name, arguments in _DEEPSEEK_CALL.findall(body):
        call = _call({"name": name.strip(), "arguments": _loads(arguments)}, allowed)
        if call is None:
            return text, []
        calls.append(call)
    if not calls or _DEEPSEEK_CALL.sub("", body).strip():
        return text, []
    return head.strip() or None, calls


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
