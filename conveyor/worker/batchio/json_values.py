"""JSON text from a user's input as Python values, with integer literals bounded.

``json.loads`` alone raises a plain ``ValueError`` (not ``JSONDecodeError``) on an integer
literal over Python's 4,300-digit limit, and a few hundred digits already overflow a float.
Here an integer longer than ``MAX_INTEGER_DIGITS`` becomes an ``OversizedInteger``: no field
accepts one, so the field it sits in is rejected by name, and an ignored field loses nothing.
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.worker.core.limits import MAX_INTEGER_DIGITS


class OversizedInteger:
    """An integer literal too long to be any field's value (only its length is kept)."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str) -> int | OversizedInteger:
    digits = len(text) - text.startswith("-")
    return OversizedInteger(digits) if digits > MAX_INTEGER_DIGITS else int(text)


def loads(text: str) -> Any:
    """``json.loads`` with bounded integers: raises only ``json.JSONDecodeError`` (bad JSON)
    or ``RecursionError`` (nested too deeply)."""
    return json.loads(text, parse_int=_parse_int)
