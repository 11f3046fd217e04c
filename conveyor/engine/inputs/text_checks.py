"""Text from users, checked before a tokenizer sees it.

A Python ``str`` can hold what no tokenizer takes: a lone surrogate, which JSON's ``\\udce9``
escape (half of a UTF-16 pair) decodes to. Rust-backed tokenizers then raise a ``TypeError``
that names nothing; here it becomes a ``ValueError`` naming the field, so the engine rejects
that one request and runs the rest.
"""

from __future__ import annotations

from typing import Any


def check_text(text: str, field: str) -> None:
    """``ValueError`` naming ``field`` unless ``text`` is valid Unicode (encodes as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field} is not valid Unicode text: it has a lone surrogate {text[exc.start]!r} at character "
            f"{exc.start} (half of a UTF-16 pair, e.g. from a JSON \\u escape)"
        ) from None


def check_texts(value: Any, field: str) -> None:
    """``check_text`` on every string inside ``value`` (nested lists and dicts, keys too)."""
    if isinstance(value, str):
        check_text(value, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                check_text(key, f"{field} key")
            check_texts(item, f"{field}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_texts(item, f"{field}[{i}]")
