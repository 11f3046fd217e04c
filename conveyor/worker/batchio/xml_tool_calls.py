"""Tool calls whose ``<tool_call>`` body is XML rather than JSON, as two families' published chat
templates write past calls (and so as their models write new ones):

- Qwen3.5 (and Qwen3-Coder): ``<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>``;
- GLM-4.5/4.6: ``NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>``.

A value is text: the templates write a string as it is and anything else as JSON, except
Qwen3.5's plain scalars, which Jinja's ``string`` writes (``21``, ``True``). So a key the
function's schema types as a string keeps its text, and any other is read back as JSON where
it reads (``True``/``False``/``None`` as Python writes them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_QWEN = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_GLM = re.compile(r"([^\s<>]+)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_PYTHON_SCALARS = {"True": True, "False": False, "None": None}


def xml_call(body: str, schemas: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """A ``<tool_call>`` body in either XML syntax as ``(name, arguments)``, or None when it is
    neither wholly (text left over is not a call)."""
    qwen = _QWEN.fullmatch(body.strip())
    if qwen is not None:
        name, inner = qwen[1].strip(), qwen[2]
        pairs = _QWEN_PARAMETER.findall(inner)
        if _QWEN_PARAMETER.sub("", inner).strip():
            return None
    else:
        glm = _GLM.fullmatch(body.strip())
        if glm is None:
            return None
        name, pairs = glm[1], _GLM_ARGUMENT.findall(glm[2])
    properties = _properties(schemas.get(name))
    return name, {key.strip(): _value(text, properties.get(key.strip())) for key, text in pairs}


def _properties(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _value(text: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return text
    if text in _PYTHON_SCALARS:
        return _PYTHON_SCALARS[text]
    try:
        return json.loads(text)
    except ValueError:
        return text
