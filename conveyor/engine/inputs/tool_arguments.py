"""Past tool calls' arguments in the form a chat template takes.

transformers documents them as objects, and most published templates iterate them or write
them with ``tojson`` (Llama 3.1, Qwen3, Qwen3.5, GLM-4.5, gpt-oss). A few concatenate them as
text (DeepSeek-V3.1 adds them to its tool separator with ``+``), which fails on an object;
for those the messages are rendered again with the arguments as JSON text, as the template's
users send them.
"""

from __future__ import annotations

import json
from typing import Any


def with_text_arguments(messages: list[Any]) -> list[Any] | None:
    """``messages`` with each past call's object arguments as JSON text, or None when no call
    has object arguments (rendering them as text would change nothing)."""
    changed = False
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list):
            out.append(message)
            continue
        texts = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), dict):
                arguments = json.dumps(fn["arguments"], ensure_ascii=False)
                call = {**call, "function": {**fn, "arguments": arguments}}
                changed = True
            texts.append(call)
        out.append({**message, "tool_calls": texts})
    return out if changed else None
