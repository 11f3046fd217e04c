"""JSONL input: one OpenAI Batch line or plain row per line (told apart per line; the batch
lines of one file must share one url)."""

from __future__ import annotations

import json
from collections.abc import Iterator

from conveyor.worker.batchio.json_values import loads
from conveyor.worker.batchio.line_reader import ByteStream, LineReader, jsonl_lines, too_long, too_many
from conveyor.worker.batchio.raw_custom_id import custom_id_from_text
from conveyor.worker.batchio.records import LineError, OneEndpoint, ParsedRequest, record_from_object
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import InputLimits


def _named(raw: bytes, limits: InputLimits) -> str | None:
    """The custom_id a line that cannot be parsed still shows (``raw_custom_id``); on a line
    that is not UTF-8, only one whose own bytes are."""
    found = custom_id_from_text(raw.decode("utf-8", errors="replace"), limits.max_custom_id_chars)
    return None if found is None or "\ufffd" in found else found


def iter_jsonl(
    stream: ByteStream, limits: InputLimits, options: RequestOptions | None = None
) -> Iterator[ParsedRequest | LineError]:
    count = 0
    options = options or RequestOptions()
    # An API batch's endpoint is fixed already: each line is checked against it.
    endpoint = OneEndpoint() if options.endpoint is None else None
    for line, raw in jsonl_lines(LineReader(stream, limits)):
        count += 1
        if count > limits.max_lines:
            raise too_many(limits)
        if raw is None:
            yield too_long(line, limits)
            continue
        try:
            obj = loads(raw.decode("utf-8"))  # bytes to json.loads would guess UTF-16/32
        except UnicodeDecodeError as exc:
            yield LineError(
                line,
                "invalid_encoding",
                f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                _named(raw, limits),
            )
            continue
        except json.JSONDecodeError as exc:
            yield LineError(line, "invalid_json", f"invalid JSON: {exc.msg} at column {exc.colno}", _named(raw, limits))
            continue
        except RecursionError:
            yield LineError(line, "invalid_json", "invalid JSON: nested too deeply", _named(raw, limits))
            continue
        mismatch = None if endpoint is None else endpoint.check(obj, line)
        yield mismatch if mismatch is not None else record_from_object(obj, line, limits, options)
