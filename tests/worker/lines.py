"""Input lines and their parsing, as the batchio, jobs and API tests build them."""

from __future__ import annotations

import io
import json

from conveyor.worker.batchio.readers import iter_input
from conveyor.worker.batchio.records import LineError, ParsedRequest
from conveyor.worker.batchio.request_body import CHAT
from conveyor.worker.core.limits import InputLimits

LIMITS = InputLimits(max_line_bytes=2048, max_lines=100, max_input_bytes=1 << 20, max_tokens=4096)


def batch_line(custom_id="r1", url=CHAT, body=None, **extra) -> dict:
    if body is None:
        body = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def chat_line(**body) -> dict:
    """A chat batch line with one user message and the given extra body fields."""
    return batch_line(body={"messages": [{"role": "user", "content": "x"}], **body})


def parse(*lines, limits: InputLimits = LIMITS, fmt="jsonl") -> list[ParsedRequest | LineError]:
    raw = b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode() for line in lines)
    return list(iter_input(io.BytesIO(raw), limits, fmt))


def one(line, limits: InputLimits = LIMITS):
    (result,) = parse(line, limits=limits)
    return result
