"""Why a job's requests failed, in a few words: its errors-file lines grouped by error code,
each with how many and the first one's line (or custom_id) and message."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.worker.core.terminal_text import printable, shown_id

MESSAGE_CHARS = 90


@dataclass
class FailureKind:
    code: str
    count: int
    where: str  # the first one's "line N" or custom_id
    message: str  # the first one's, cut to MESSAGE_CHARS

    def describe(self) -> str:
        return f"{self.count} {self.code} ({self.where}: {self.message})"


def _one(line: bytes) -> tuple[str, str, str]:
    """(code, where, message) of one errors-file line."""
    try:
        obj = json.loads(line)
    except ValueError:
        return "unreadable", "?", "an errors-file line that is not JSON"
    error = obj.get("error")
    if not error:  # a request that ran and failed: OpenAI's error body in the response
        error = ((obj.get("response") or {}).get("body") or {}).get("error") or {}
    # A custom_id is the user's text, shown escaped: no control sequence reaches a terminal.
    where = f"line {error['line']}" if error.get("line") is not None else shown_id(obj.get("custom_id"))
    message = printable(str(error.get("message") or ""))
    if len(message) > MESSAGE_CHARS:
        message = message[: MESSAGE_CHARS - 3] + "..."
    return str(error.get("code") or "error"), where, message


def summarize_failures(lines: Iterable[bytes], kinds: int = 3) -> tuple[list[FailureKind], int]:
    """The most frequent ``kinds`` kinds of failure, most frequent first, and how many other
    kinds there were."""
    found: dict[str, FailureKind] = {}
    for line in lines:
        if not line.strip():
            continue
        code, where, message = _one(line)
        kind = found.get(code)
        if kind is None:
            found[code] = FailureKind(code, 1, where, message)
        else:
            kind.count += 1
    ranked = sorted(found.values(), key=lambda k: -k.count)
    return ranked[:kinds], max(0, len(ranked) - kinds)
