"""Text from users made safe to print on a terminal: a ``custom_id``, a message quoting one.

A character a terminal could act on (C0 controls such as ESC and BEL, DEL, C1 controls, and
Python's other unprintables) is shown as ``repr`` escapes it (``\\x1b``); newlines and tabs
of a message stay as they are.
"""

from __future__ import annotations

import re

_KEPT = "\n\t"
# The controls JSON leaves raw in a string (it escapes only U+0000 to U+001F).
_JSON_RAW_CONTROLS = re.compile("[\x7f-\x9f]")


def printable(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in _KEPT else repr(c)[1:-1] for c in text)


def shown_id(value: object) -> str:
    """A user-given id as printed: quoted and escaped (``repr``)."""
    return repr(value)


def json_for_terminal(line: bytes) -> bytes:
    """A JSON line with DEL and the C1 controls as ``\\u`` escapes: the same JSON value, and
    nothing a terminal acts on (JSON escapes the other controls itself)."""
    text = line.decode("utf-8", "backslashreplace")
    if not _JSON_RAW_CONTROLS.search(text):
        return line
    return _JSON_RAW_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text).encode("utf-8")
