"""``chat_template_kwargs``: extra variables a request hands its chat template
(``enable_thinking`` for Qwen3, ``reasoning_effort`` for gpt-oss, ``thinking`` for others).

They become keyword arguments of ``apply_chat_template``, so the names it takes for itself are
refused, as are values that are not plain JSON (a template sees them as Jinja variables).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# apply_chat_template's own parameters, and the variables it sets from them.
_RESERVED = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
        "bos_token", "eos_token", "raise_exception",
        # the tokenizer's special tokens (a template would print a request's value as one) and
        # transformers 5's switch that escapes control tokens in message text
        "pad_token", "unk_token", "additional_special_tokens", "sanitize_control_tokens",
    }
)  # fmt: skip


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """The checked kwargs (``{}`` for None); ``ValueError`` naming what is wrong."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs has {len(kwargs)} entries; at most {MAX_TEMPLATE_KWARGS}")
    for name in kwargs:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in _RESERVED:
            raise ValueError(f"chat_template_kwargs: {name!r} is set by the engine, not by a request")
    try:
        size = len(json.dumps(kwargs, allow_nan=False))
    except (TypeError, ValueError):
        raise ValueError(
            "chat_template_kwargs values must be plain JSON (strings, numbers, booleans, lists, objects)"
        ) from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"chat_template_kwargs is {size} bytes as JSON; at most {MAX_TEMPLATE_KWARGS_BYTES}")
    return dict(kwargs)
