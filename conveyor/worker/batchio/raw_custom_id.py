"""The ``custom_id`` of a line that is not JSON, read from its text, so the line's error is
named as the user named the request rather than ``line-<n>``.

Only a ``"custom_id": "..."`` pair where a key can stand (after ``{`` or ``,``), exactly once
in the line, with a string value that decodes as JSON and ends where a value ends, is taken;
anything else (no such pair, two of them, a value too long, a bad escape, a NUL or lone
surrogate) gives ``None``.
"""

from __future__ import annotations

import json
import re

from conveyor.worker.core.limits import MAX_CUSTOM_ID_CHARS

# An escape takes at most 12 characters of text for one character (a surrogate pair's two \uXXXX).
_MAX_RAW_CHARS = 12 * MAX_CUSTOM_ID_CHARS
_KEY = re.compile(r'(?:^|[{,])\s*"custom_id"\s*:\s*')
# A JSON string, then what may follow a value: a comma, the object's end or the line's end.
_STRING = re.compile(r'("(?:[^"\\\x00-\x1f]|\\.){1,' + str(_MAX_RAW_CHARS) + r'}")\s*(?:[,}]|$)')


def custom_id_from_text(text: str, max_chars: int = MAX_CUSTOM_ID_CHARS) -> str | None:
    """The one ``custom_id`` string ``text`` (a malformed JSON line) gives, or ``None``."""
    keys = _KEY.finditer(text)
    first = next(keys, None)
    if first is None or next(keys, None) is not None:
        return None  # none, or more than one: which would be the line's?
    value = _STRING.match(text, first.end())
    if value is None:
        return None
    try:
        decoded = json.loads(value.group(1))
        decoded.encode("utf-8")  # a lone surrogate from an escape cannot be written back
    except (ValueError, UnicodeEncodeError):
        return None
    if not isinstance(decoded, str) or len(decoded) > max_chars or "\x00" in decoded:
        return None
    return decoded
