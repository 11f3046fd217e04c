"""CSV input: a header row with a ``prompt`` or ``messages`` column (optional ``custom_id``/``id``
and sampling columns; a cell holding JSON such as ``["a","b"]`` or ``0.7`` is read as JSON). A
``messages`` cell is a JSON list of ``{"role", "content"}`` objects; a row whose ``messages``
cell is empty uses its ``prompt``. ``docs/user-guide/datasets.md`` lists the columns."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from typing import Any

from conveyor.worker.batchio.json_values import loads
from conveyor.worker.batchio.line_reader import ByteStream, LineReader, too_many
from conveyor.worker.batchio.records import InputError, LineError, ParsedRequest, guess_custom_id, record_from_object
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import InputLimits


class _CsvFeed:
    """Decoded physical lines for csv.reader, bounding each record to max_line_bytes."""

    class Problem(Exception):
        def __init__(self, code: str, message: str) -> None:
            super().__init__(message)
            self.code, self.message = code, message

    def __init__(self, lines: Iterator[tuple[int, bytes | None]], limits: InputLimits) -> None:
        self._lines, self._limits = lines, limits
        self.record_start = 0
        self._record_bytes = 0
        self._first = True

    def begin_record(self) -> None:
        self.record_start = 0
        self._record_bytes = 0

    def __iter__(self) -> _CsvFeed:
        return self

    def __next__(self) -> str:
        line, raw = next(self._lines)
        if not self.record_start:
            self.record_start = line
        if raw is None:
            raise self.Problem("line_too_long", f"line {line} is longer than {self._limits.max_line_bytes} bytes")
        self._record_bytes += len(raw)
        if self._record_bytes > self._limits.max_line_bytes:
            raise self.Problem(
                "line_too_long", f"CSV record is longer than {self._limits.max_line_bytes} bytes (an unclosed quote?)"
            )
        if self._first:
            self._first = False
            if raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.Problem("invalid_encoding", f"line {line} is not valid UTF-8 ({exc.reason})") from None


def _csv_value(text: str) -> Any:
    """A CSV cell: empty -> None; JSON when it parses (numbers, true, lists); else the text."""
    if text == "":
        return None
    try:
        return loads(text)
    except (ValueError, RecursionError):
        return text


def iter_csv(
    stream: ByteStream, limits: InputLimits, options: RequestOptions | None = None
) -> Iterator[ParsedRequest | LineError]:
    # csv's field limit is process-wide; records are bounded by _CsvFeed, so only raise it.
    if csv.field_size_limit() < limits.max_line_bytes:
        csv.field_size_limit(limits.max_line_bytes)
    feed = _CsvFeed(iter(LineReader(stream, limits)), limits)
    reader = csv.reader(feed)
    header: list[str] | None = None
    count = 0
    while True:
        feed.begin_record()
        try:
            row = next(reader)
        except StopIteration:
            break
        except (_CsvFeed.Problem, csv.Error) as exc:
            if header is None:
                raise InputError(f"cannot read the CSV header: {exc}") from None
            count += 1
            if count > limits.max_lines:
                raise too_many(limits, "rows") from None
            code = exc.code if isinstance(exc, _CsvFeed.Problem) else "invalid_csv"
            yield LineError(feed.record_start, code, str(exc))
            reader = csv.reader(feed)  # resume at the next physical line
            continue
        if not any(cell.strip() for cell in row):
            continue
        if header is None:
            header = _header(row)
            continue
        count += 1
        if count > limits.max_lines:
            raise too_many(limits, "rows")
        yield _row_record(header, row, feed.record_start, limits, options)


def _header(row: list[str]) -> list[str]:
    """The column names (lower case), refused without a column that holds the prompt."""
    header = [h.strip().lower() for h in row]
    if not {"prompt", "messages", "input"} & set(header):
        raise InputError(f"the CSV header has no 'prompt', 'messages' or 'input' column (columns: {', '.join(header)})")
    return header


def _row_record(
    header: list[str], row: list[str], line: int, limits: InputLimits, options: RequestOptions | None
) -> ParsedRequest | LineError:
    """One data row as a request, or as that row's error."""
    if len(row) > len(header):
        return LineError(line, "invalid_csv", f"row has {len(row)} fields but the header has {len(header)}")
    obj: dict[str, Any] = {}
    for name, cell in zip(header, row, strict=False):  # a short row: missing cells are empty
        obj[name] = cell if name in ("prompt", "input", "custom_id", "id") else _csv_value(cell)
    obj = {k: v for k, v in obj.items() if v not in (None, "")}
    if isinstance(obj.get("messages"), str):  # not JSON: say so rather than "not a list"
        what = 'the messages cell must be a JSON list such as [{"role": "user", "content": "Hi"}]'
        return LineError(line, "invalid_value", what, guess_custom_id(obj), "messages")
    if "input" in header and "prompt" not in header:  # an embeddings row: an empty input is its error
        obj["input"] = obj.get("input", "")
    elif "messages" not in obj:  # an empty prompt is that row's error, not a missing column
        obj["prompt"] = obj.get("prompt", "")
    return record_from_object(obj, line, limits, options)
