"""``response_format`` (OpenAI) and ``structured_outputs`` (vLLM's extension) of a request body,
as the engine's ``StructuredOutputs`` fields: a JSON-ready dict such as ``{"json": schema}``.

Only the shape and the size are checked here (this layer has no grammar library): whether the
engine's grammar library can compile a schema is learnt when the request runs, and a schema it
cannot compile fails that request alone, with the library's reason.
"""

from __future__ import annotations

import json
import re
from typing import Any

from conveyor.worker.batchio.body_errors import InvalidRequest, shown
from conveyor.worker.core.limits import InputLimits

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# vLLM's structured_outputs fields (``json_object`` is a bool there too).
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def schema_size(schema: Any) -> int:
    """Bytes of ``schema`` as compact JSON."""
    return len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


def check_schema(param: str, schema: Any, limits: InputLimits) -> dict[str, Any]:
    """A JSON Schema object within the size and depth limits."""
    if not isinstance(schema, dict):
        raise InvalidRequest("invalid_value", f"{param} must be a JSON Schema object, got {shown(schema)}", param)
    size = schema_size(schema)
    if size > limits.max_schema_bytes:
        raise InvalidRequest(
            "invalid_value", f"{param} is {size} bytes as JSON; at most {limits.max_schema_bytes}", param
        )
    if _depth(schema) > limits.max_schema_depth:
        raise InvalidRequest(
            "invalid_value", f"{param} is nested more than {limits.max_schema_depth} levels deep", param
        )
    return schema


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children)
    return deepest


def response_format(value: Any, limits: InputLimits) -> dict[str, Any] | None:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or
    ``json_schema`` (``name``, ``schema``, ``strict``, ``description``; the schema is always
    enforced, strict or not)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return {"json_object": True}
    if kind == "json_schema":
        extra = sorted(set(value) - {"type", "json_schema"})
        if extra:
            raise InvalidRequest("unknown_parameter", f"unknown field response_format.{extra[0]}", "response_format")
        spec = value.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise InvalidRequest("invalid_value", f"{param} must be an object with name and schema", param)
        unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
        if unknown:
            raise InvalidRequest("unknown_parameter", f"unknown field {param}.{unknown[0]}", f"{param}.{unknown[0]}")
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequest(
                "invalid_value", f"{param}.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {shown(name)}", param
            )
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise InvalidRequest("invalid_value", f"{param}.strict must be true or false", f"{param}.strict")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise InvalidRequest("invalid_value", f"{param}.description must be a string", f"{param}.description")
        if spec.get("schema") is None:  # OpenAI: no schema, any JSON object
            return {"json_object": True}
        return {"json": check_schema(f"{param}.schema", spec["schema"], limits)}
    raise InvalidRequest(
        "invalid_value",
        "response_format must be {type: text}, {type: json_object} or {type: json_schema, json_schema: {...}}, "
        f"got {shown(value)}",
        "response_format",
    )


def structured_outputs(value: Any, limits: InputLimits) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` extension: exactly one of ``json`` (a schema),
    ``json_object``, ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark)."""
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequest("invalid_value", f"{param} must be an object, got {shown(value)}", param)
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
    if unknown:
        raise InvalidRequest("unknown_parameter", f"unknown field {param}.{unknown[0]}", f"{param}.{unknown[0]}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if len(given) != 1:
        raise InvalidRequest(
            "invalid_value", f"{param} takes exactly one of {', '.join(_STRUCTURED_KEYS)}, got {shown(value)}", param
        )
    kind, v = next(iter(given.items()))
    where = f"{param}.{kind}"
    if kind == "json":
        return {"json": _json_schema(where, v, limits)}
    if kind == "json_object":
        if v is not True:
            raise InvalidRequest("invalid_value", f"{where} must be true", where)
        return {"json_object": True}
    if kind == "choice":
        return {"choice": _choices(where, v, limits)}
    if not isinstance(v, str) or not v or len(v) > limits.max_schema_bytes:
        what = f"a non-empty string of at most {limits.max_schema_bytes} characters"
        raise InvalidRequest("invalid_value", f"{where} must be {what}", where)
    return {kind: v}


def _json_schema(where: str, value: Any, limits: InputLimits) -> dict[str, Any]:
    """A JSON schema given as an object or as JSON text, checked."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidRequest("invalid_value", f"{where} is not valid JSON", where) from None
    return check_schema(where, value, limits)


def _choices(where: str, value: Any, limits: InputLimits) -> list[str]:
    """``choice``: 1 to ``max_choices`` non-empty strings, ``max_schema_bytes`` characters in all."""
    if not isinstance(value, list) or not value or len(value) > limits.max_choices:
        raise InvalidRequest(
            "invalid_value", f"{where} must be a list of 1 to {limits.max_choices} strings, got {shown(value)}", where
        )
    if not all(isinstance(c, str) and c for c in value):
        raise InvalidRequest("invalid_value", f"{where} must hold non-empty strings, got {shown(value)}", where)
    if sum(len(c) for c in value) > limits.max_schema_bytes:
        raise InvalidRequest("invalid_value", f"{where} is longer than {limits.max_schema_bytes} characters", where)
    return value
