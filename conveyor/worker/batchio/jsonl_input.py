"""JSONL input: one OpenAI Batch line or plain row per line (told apart per line; the batch
lines of one file must share one url)."""

from __future__ import annotations

import json
from collections.abc import Iterator

from conveyor.worker.batchio.json_values import loads
from conveyor.worker.batchio.line_reader import ByteStream, LineReader, too_long, too_many
from conveyor.worker.batchio.records import LineError, OneEndpoint, ParsedRequest, record_from_object
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import InputLimits


def iter_jsonl(
    stream: ByteStream, limits: InputLimits, options: RequestOptions | None = None
) -> Iterator[ParsedRequest | LineError]:
    count = 0
    endpoint = OneEndpoint()
    for line, raw in LineReader(stream, limits):
        if line == 1 and raw is not None:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte order mark
        if raw is not None and not raw.strip():
            continue
        count += 1
        if count > limits.max_lines:
            raise too_many(limits)
        if raw is None:
            yield too_long(line, limits)
            continue
        try:
            obj = loads(raw.decode("utf-8"))  # bytes to json.loads would guess UTF-16/32
        except UnicodeDecodeError as exc:
            yield LineError(line, "invalid_encoding", f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
            continue
        except json.JSONDecodeError as exc:
            yield LineError(line, "invalid_json", f"invalid JSON: {exc.msg} at column {exc.colno}")
            continue
        except RecursionError:
            yield LineError(line, "invalid_json", "invalid JSON: nested too deeply")
            continue
        mismatch = endpoint.check(obj, line)
        yield mismatch if mismatch is not None else record_from_object(obj, line, limits, options)
