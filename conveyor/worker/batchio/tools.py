"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, and the tool calls of
its answer.

The tools go to the chat template (which renders them in the model's own format). A forced
call decodes under a JSON Schema built from the functions' ``parameters``: ``tool_choice`` naming
a function constrains the output to that function's arguments, ``required`` to a JSON array of
``{"name", "arguments"}`` calls to any of them (one only without ``parallel_tool_calls``). With
``auto`` the model writes freely and ``tool_parsers`` reads calls out of its text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.worker.batchio.body_errors import InvalidRequest, shown
from conveyor.worker.batchio.response_format import check_schema, schema_size
from conveyor.worker.batchio.tool_parsers import parse_tool_calls
from conveyor.worker.core.limits import InputLimits

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "function"


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools (OpenAI's tool objects, checked) and how it may call them."""

    tools: list[dict[str, Any]]
    choice: str  # AUTO, NONE, REQUIRED or NAMED
    name: str | None = None  # the function a NAMED choice forces
    parallel: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"tools": self.tools, "choice": self.choice, "name": self.name, "parallel": self.parallel}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ToolRequest:
        return cls(data["tools"], data["choice"], data.get("name"), data.get("parallel", True))

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def structured_outputs(self) -> dict[str, Any] | None:
        """The engine's constraint for a forced call (None for ``auto`` and ``none``)."""
        if self.choice == NAMED:
            assert self.name is not None
            return {"json": self.parameters(self.name)}
        if self.choice != REQUIRED:
            return None
        defs: dict[str, Any] = {}
        variants = []
        for name in self.names:
            params = dict(self.parameters(name))
            # $ref "#/$defs/X" resolves from the root: each function's $defs move up there.
            for key in ("$defs", "definitions"):
                for def_name, definition in (params.pop(key, None) or {}).items():
                    if defs.setdefault(f"{key}/{def_name}", definition) != definition:
                        raise InvalidRequest(
                            "invalid_value",
                            f'tools: two functions define {key}["{def_name}"] differently; a required '
                            "tool_choice needs one meaning for each name",
                            "tool_choice",
                        )
            variants.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": variants}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        for path, sub in defs.items():
            key, def_name = path.split("/", 1)
            schema.setdefault(key, {})[def_name] = sub
        return {"json": schema}


def parse_tools(body: dict[str, Any], limits: InputLimits) -> ToolRequest | None:
    """The request's tools, or None when it has none (``tool_choice`` then must be absent or
    ``none``, as OpenAI has it)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("invalid_value", f"parallel_tool_calls must be true or false, got {shown(parallel)}")
    if tools is None or tools == []:
        if choice is not None and choice != NONE:
            raise InvalidRequest("invalid_value", "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > limits.max_tools:
        raise InvalidRequest(
            "invalid_value", f"tools must be a list of at most {limits.max_tools} tools, got {shown(tools)}", "tools"
        )
    checked = [_tool(i, t, limits) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise InvalidRequest("invalid_value", "tools: function names must be unique", "tools")
    total = sum(schema_size(t) for t in checked)
    if total > limits.max_schema_bytes:
        raise InvalidRequest(
            "invalid_value", f"tools are {total} bytes as JSON; at most {limits.max_schema_bytes} in all", "tools"
        )
    name = None
    if choice is None or choice in (AUTO, NONE, REQUIRED):
        kind = choice or AUTO
    elif isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "function"}:
        fn = choice["function"]
        name = fn.get("name") if isinstance(fn, dict) and set(fn) == {"name"} else None
        if name not in names:
            raise InvalidRequest(
                "invalid_value", f"tool_choice names function {shown(name)}, which is not in tools", "tool_choice"
            )
        kind = NAMED
    else:
        raise InvalidRequest(
            "invalid_value",
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {shown(choice)}",
            "tool_choice",
        )
    request = ToolRequest(checked, kind, name, True if parallel is None else parallel)
    forced = request.structured_outputs()
    if forced is not None:
        check_schema("tools", forced["json"], limits)
    return request


def _tool(i: int, tool: Any, limits: InputLimits) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
        raise InvalidRequest(
            "invalid_value", f'{where} must be {{"type": "function", "function": {{...}}}}, got {shown(tool)}', where
        )
    fn = tool["function"]
    if not isinstance(fn, dict):
        raise InvalidRequest("invalid_value", f"{where}.function must be an object", f"{where}.function")
    unknown = sorted(set(fn) - _FUNCTION_KEYS)
    if unknown:
        raise InvalidRequest(
            "unknown_parameter", f"unknown field {where}.function.{unknown[0]}", f"{where}.function.{unknown[0]}"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(
            "invalid_value",
            f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {shown(name)}",
            f"{where}.function.name",
        )
    out: dict[str, Any] = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise InvalidRequest("invalid_value", f"{where}.function.description must be a string", where)
        out["description"] = fn["description"]
    if fn.get("parameters") is not None:
        out["parameters"] = check_schema(f"{where}.function.parameters", fn["parameters"], limits)
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise InvalidRequest("invalid_value", f"{where}.function.strict must be true or false", where)
    return {"type": "function", "function": out}


# ---- the answer -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolAnswer:
    """One sample's message: its text content (None when it is only tool calls), its calls
    (OpenAI's ``tool_calls`` entries) and its finish reason."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None


def answer(tools: ToolRequest, text: str, finish_reason: str | None, call_id: Callable[[int], str]) -> ToolAnswer:
    """The message of one sample of a request with tools. ``call_id(k)`` names its k-th call.
    A forced call cut short by ``max_tokens`` keeps ``finish_reason`` ``length``."""
    calls: list[tuple[str, str]] = []
    content: str | None = text
    if tools.choice == NAMED:
        assert tools.name is not None
        calls, content = [(tools.name, text)], None
    elif tools.choice == REQUIRED:
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if isinstance(items, list):
            calls = [(c["name"], _json(c["arguments"])) for c in items if isinstance(c, dict) and "name" in c]
            content = None
    elif tools.choice == AUTO:
        content, calls = parse_tool_calls(text, tools.names, {name: tools.parameters(name) for name in tools.names})
    if not calls:
        return ToolAnswer(text, None, finish_reason)
    tool_calls = [
        {"id": call_id(k), "type": "function", "function": {"name": name, "arguments": arguments}}
        for k, (name, arguments) in enumerate(calls)
    ]
    return ToolAnswer(content, tool_calls, "tool_calls" if finish_reason == "stop" else finish_reason)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def apply_tools(body: dict[str, Any], sampling: dict[str, Any], limits: InputLimits) -> ToolRequest | None:
    """Read a chat body's tools; a forced call's constraint goes into ``sampling`` (the
    engine's ``structured_outputs``), which must not hold one already."""
    tools = parse_tools(body, limits)
    forced = tools.structured_outputs() if tools is not None else None
    if forced is not None:
        if "structured_outputs" in sampling:
            raise InvalidRequest(
                "invalid_request",
                "response_format (or structured_outputs) cannot be combined with a tool_choice that forces a call",
                "tool_choice",
            )
        sampling["structured_outputs"] = forced
    return tools
