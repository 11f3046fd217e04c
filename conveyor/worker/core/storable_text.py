"""Text that PostgreSQL can store: the one check every door runs on what a user gives.

PostgreSQL's ``text`` and ``JSONB`` refuse NUL (U+0000), and a lone surrogate (half of a
UTF-16 pair, which a JSON ``\\ud800`` escape decodes to) has no UTF-8 form at all, so either
one in a value that is stored or queried would fail the statement (a 500 where SQLite
answers). The HTTP API, ``conveyor submit`` (``Client.submit``) and broker submissions all
check what they store or look up with ``check_storable``; it names the field at fault.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class UnstorableText(ValueError):
    """A user's value holding NUL or a lone surrogate; ``field`` names where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _fault(text: str) -> tuple[int, str] | None:
    for i, c in enumerate(text):
        if c == "\x00":
            return i, "a NUL character (\\u0000)"
        if "\ud800" <= c <= "\udfff":
            return i, f"a lone surrogate ({c!r}, half of a UTF-16 pair)"
    return None


def check_storable(value: Any, field: str) -> None:
    """``UnstorableText`` naming ``field`` (``field.key``, ``field[i]`` inside objects and
    lists, keys included) if any string in ``value`` holds NUL or a lone surrogate."""
    if isinstance(value, str):
        fault = _fault(value)
        if fault is not None:
            at, what = fault
            message = f"{field} must be text without NUL characters or lone surrogates; it has {what} at character {at}"
            raise UnstorableText(field, message)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_storable(key, f"{field} key")
            check_storable(item, f"{field}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_storable(item, f"{field}[{i}]")


def storable(text: Any) -> str:
    """``text`` with NUL and lone surrogates replaced by U+FFFD: for recording a refusal that
    quotes the offending value (``""`` for a value that is not text)."""
    if not isinstance(text, str):
        return ""
    if _fault(text) is None:
        return text
    return "".join(_REPLACEMENT if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in text)
