"""Input files in, OpenAI Batch output lines out (builders in ``worker.batch_output``).

Input (streamed line by line; a whole file is never held in memory):

- OpenAI Batch JSONL: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
  "/v1/completions", "body": {...}}``; unknown fields are errors, as with OpenAI.
- plain JSONL: ``{"prompt": ...}`` or ``{"messages": [...]}`` plus optional ``custom_id``
  (or ``id``) and sampling fields at the top level; other fields are ignored (dataset rows).
- CSV with a header row and a ``prompt`` column (optional ``custom_id``/``id`` and sampling
  columns; a cell holding JSON such as ``["a","b"]`` or ``0.7`` is read as JSON).

``iter_input`` yields, per non-blank line, a ``ParsedRequest`` or a ``LineError`` naming the
line number and what is wrong; a bad line never stops the rest. Whole-file problems (over
the size or line limit, a CSV header without a prompt column) raise ``InputError``.
Plain rows without an id get ``custom_id = "line-<n>"``. A repeated ``custom_id`` is an
error on the later line. Blank lines are skipped and not counted.
"""

from __future__ import annotations

import csv
import enum
import hashlib
import json
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from worker.batch_output import Choice, dumps_line, error_line, output_line, response_body, stable_id
from worker.request_body import (
    CHAT,
    COMPLETIONS,
    ENDPOINTS,
    InvalidRequest,
    parse_messages,
    parse_prompt,
    sampling_from_body,
)
from worker.settings import InputLimits

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "ENDPOINTS",
    "Choice",
    "InputError",
    "InputFormat",
    "InputTooLarge",
    "LineError",
    "ParsedRequest",
    "detect_format",
    "dumps_line",
    "error_line",
    "iter_input",
    "line_error_line",
    "output_line",
    "response_body",
    "stable_id",
]  # fmt: skip

_OPENAI_KEYS = {"custom_id", "method", "url", "body"}
_SKIP_CHUNK = 64 * 1024


class InputFormat(str, enum.Enum):
    jsonl = "jsonl"  # OpenAI Batch lines and plain prompt lines, told apart per line
    csv = "csv"
    parquet = "parquet"  # a prompt (or messages) column; rows numbered from 1 like lines


class InputError(ValueError):
    """The input as a whole cannot be accepted (the job fails at validation)."""


class InputTooLarge(InputError):
    """The input exceeds a size or count limit."""


@dataclass(frozen=True)
class ParsedRequest:
    """One valid input line. Exactly one of ``prompt`` / ``messages`` is set."""

    line: int  # 1-based line number in the input file (CSV: the record's first line)
    custom_id: str
    endpoint: str  # CHAT or COMPLETIONS
    sampling: dict[str, Any]  # SamplingParams(**sampling)
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None

    def to_json(self) -> dict[str, Any]:
        """A compact dict for a shard's input file (``from_json`` reads it back)."""
        data: dict[str, Any] = {"line": self.line, "custom_id": self.custom_id, "endpoint": self.endpoint}
        if self.messages is not None:
            data["messages"] = self.messages
        else:
            data["prompt"] = self.prompt
        data["sampling"] = self.sampling
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ParsedRequest:
        return cls(
            line=data["line"],
            custom_id=data["custom_id"],
            endpoint=data["endpoint"],
            sampling=dict(data["sampling"]),
            prompt=data.get("prompt"),
            messages=data.get("messages"),
        )


@dataclass(frozen=True)
class LineError:
    """An input line rejected at validation."""

    line: int
    code: str  # invalid_json, invalid_request, invalid_value, unknown_parameter, unsupported,
    #            missing_prompt, duplicate_custom_id, line_too_long, invalid_encoding, invalid_csv
    message: str
    custom_id: str | None = None
    param: str | None = None


def detect_format(filename: str) -> InputFormat:
    """CSV for ``*.csv``, Parquet for ``*.parquet``/``*.pq``, else JSONL (OpenAI Batch or
    plain, told apart per line)."""
    name = filename.lower()
    if name.endswith(".csv"):
        return InputFormat.csv
    if name.endswith((".parquet", ".pq")):
        return InputFormat.parquet
    return InputFormat.jsonl


# ---- reading lines under limits ---------------------------------------------------------


class _Lines:
    """Physical lines of a binary stream as ``(line_no, bytes | None)``; None = too long.

    Enforces ``max_input_bytes`` and ``max_line_bytes`` (the newline not counted) while
    reading, so memory stays at one line whatever the file.
    """

    def __init__(self, stream: BinaryIO, limits: InputLimits) -> None:
        self._stream, self._limits = stream, limits
        self.line_no = 0
        self._total = 0

    def _count(self, n: int) -> None:
        self._total += n
        if self._total > self._limits.max_input_bytes:
            raise InputTooLarge(f"input is larger than {self._limits.max_input_bytes} bytes (CONVEYOR_MAX_INPUT_BYTES)")

    def __iter__(self) -> Iterator[tuple[int, bytes | None]]:
        limit = self._limits.max_line_bytes
        while True:
            raw = self._stream.readline(limit + 2)  # room for "\r\n"
            if not raw:
                return
            self._count(len(raw))
            self.line_no += 1
            if len(raw.rstrip(b"\r\n")) > limit:
                while not raw.endswith(b"\n"):  # skip the rest of the line
                    raw = self._stream.readline(_SKIP_CHUNK)
                    if not raw:
                        break
                    self._count(len(raw))
                yield self.line_no, None
            else:
                yield self.line_no, raw


class _Ids:
    """Duplicate custom_id detection in bounded memory (an 8-byte hash per id)."""

    def __init__(self) -> None:
        self._first_line: dict[int, int] = {}

    def check(self, custom_id: str, line: int) -> LineError | None:
        key = int.from_bytes(hashlib.blake2b(custom_id.encode("utf-8"), digest_size=8).digest(), "big")
        first = self._first_line.setdefault(key, line)
        if first == line:
            return None
        return LineError(
            line, "duplicate_custom_id", f"custom_id {custom_id!r} was already used on line {first}", custom_id
        )


def _too_long(line: int, limits: InputLimits) -> LineError:
    return LineError(
        line, "line_too_long", f"line is longer than {limits.max_line_bytes} bytes (CONVEYOR_MAX_LINE_BYTES)"
    )


def _custom_id(value: Any, limits: InputLimits, *, required: bool, line: int) -> str:
    if value is None and not required:
        return f"line-{line}"
    if isinstance(value, int) and not isinstance(value, bool) and not required:
        value = str(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequest("invalid_request", "custom_id must be a non-empty string", "custom_id")
    if len(value) > limits.max_custom_id_chars:
        raise InvalidRequest(
            "invalid_value", f"custom_id is longer than {limits.max_custom_id_chars} characters", "custom_id"
        )
    if "\x00" in value or not _encodable(value):
        raise InvalidRequest(
            "invalid_value", "custom_id must be UTF-8 text without NUL characters or lone surrogates", "custom_id"
        )
    return value


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _request_from_object(obj: Any, line: int, limits: InputLimits) -> ParsedRequest:
    """One JSON object (OpenAI Batch line or plain row) -> ParsedRequest, or InvalidRequest."""
    if not isinstance(obj, dict):
        raise InvalidRequest("invalid_request", f"a line must be a JSON object, got {type(obj).__name__}")
    if "body" in obj:  # OpenAI Batch line
        custom_id = _custom_id(obj.get("custom_id"), limits, required=True, line=line)
        extra = sorted(set(obj) - _OPENAI_KEYS)
        if extra:
            raise InvalidRequest("unknown_parameter", f"unknown field(s) {', '.join(extra)} in a batch line", extra[0])
        if obj.get("method") != "POST":
            raise InvalidRequest("invalid_value", f'method must be "POST", got {obj.get("method")!r}', "method")
        endpoint = obj.get("url")
        if endpoint not in ENDPOINTS:
            raise InvalidRequest(
                "invalid_value", f"url must be one of {', '.join(ENDPOINTS)}, got {endpoint!r:.80}", "url"
            )
        body = obj["body"]
        if not isinstance(body, dict):
            raise InvalidRequest("invalid_request", "body must be a JSON object", "body")
        strict = True
    else:  # a plain dataset row
        custom_id = _custom_id(obj.get("custom_id", obj.get("id")), limits, required=False, line=line)
        body, strict = obj, False
        endpoint = CHAT if "messages" in obj else COMPLETIONS
    if endpoint == CHAT:
        if "messages" not in body:
            raise InvalidRequest("missing_prompt", "a chat request needs messages", "messages")
        messages = parse_messages(body["messages"], limits)
        sampling = sampling_from_body(body, endpoint, limits, strict=strict)
        return ParsedRequest(line, custom_id, endpoint, sampling, messages=messages)
    if "prompt" not in body:
        what = "a completions request needs a prompt" if strict else "no prompt or messages field"
        raise InvalidRequest("missing_prompt", what, "prompt")
    prompt = parse_prompt(body["prompt"])
    sampling = sampling_from_body(body, endpoint, limits, strict=strict)
    return ParsedRequest(line, custom_id, endpoint, sampling, prompt=prompt)


def _error(line: int, exc: InvalidRequest, custom_id: str | None) -> LineError:
    return LineError(line, exc.code, exc.message, custom_id, exc.param)


def _guess_custom_id(obj: Any) -> str | None:
    if isinstance(obj, dict):
        cid = obj.get("custom_id", obj.get("id"))
        if isinstance(cid, (str, int)) and not isinstance(cid, bool):
            return str(cid)[:512]
    return None


def _iter_jsonl(stream: BinaryIO, limits: InputLimits) -> Iterator[ParsedRequest | LineError]:
    count = 0
    for line, raw in _Lines(stream, limits):
        if raw is not None and not raw.strip():
            continue
        count += 1
        if count > limits.max_lines:
            raise InputTooLarge(f"input has more than {limits.max_lines} lines (CONVEYOR_MAX_LINES_PER_JOB)")
        if raw is None:
            yield _too_long(line, limits)
            continue
        if line == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # UTF-8 byte order mark
        try:
            obj = json.loads(raw.decode("utf-8"))  # bytes to json.loads would guess UTF-16/32
        except UnicodeDecodeError as exc:
            yield LineError(line, "invalid_encoding", f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
            continue
        except json.JSONDecodeError as exc:
            yield LineError(line, "invalid_json", f"invalid JSON: {exc.msg} at column {exc.colno}")
            continue
        except RecursionError:
            yield LineError(line, "invalid_json", "invalid JSON: nested too deeply")
            continue
        try:
            yield _request_from_object(obj, line, limits)
        except InvalidRequest as exc:
            yield _error(line, exc, _guess_custom_id(obj))


# ---- CSV ----------------------------------------------------------------------------------


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
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _iter_csv(stream: BinaryIO, limits: InputLimits) -> Iterator[ParsedRequest | LineError]:
    # csv's field limit is process-wide; records are bounded by _CsvFeed, so only raise it.
    if csv.field_size_limit() < limits.max_line_bytes:
        csv.field_size_limit(limits.max_line_bytes)
    feed = _CsvFeed(iter(_Lines(stream, limits)), limits)
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
                raise InputTooLarge(
                    f"input has more than {limits.max_lines} rows (CONVEYOR_MAX_LINES_PER_JOB)"
                ) from None
            code = exc.code if isinstance(exc, _CsvFeed.Problem) else "invalid_csv"
            yield LineError(feed.record_start, code, str(exc))
            reader = csv.reader(feed)  # resume at the next physical line
            continue
        if not any(cell.strip() for cell in row):
            continue
        if header is None:
            header = [h.strip().lower() for h in row]
            if "prompt" not in header:
                raise InputError(f"the CSV header has no 'prompt' column (columns: {', '.join(header)})")
            continue
        count += 1
        if count > limits.max_lines:
            raise InputTooLarge(f"input has more than {limits.max_lines} rows (CONVEYOR_MAX_LINES_PER_JOB)")
        line = feed.record_start
        if len(row) > len(header):
            yield LineError(line, "invalid_csv", f"row has {len(row)} fields but the header has {len(header)}")
            continue
        obj: dict[str, Any] = {}
        for name, cell in zip(header, row, strict=False):  # a short row: missing cells are empty
            obj[name] = cell if name in ("prompt", "custom_id", "id") else _csv_value(cell)
        obj = {k: v for k, v in obj.items() if v not in (None, "")} | {"prompt": obj.get("prompt", "")}
        try:
            yield _request_from_object(obj, line, limits)
        except InvalidRequest as exc:
            yield _error(line, exc, _guess_custom_id(obj))


_PARQUET_SPOOL_BYTES = 64 * 1024 * 1024  # larger inputs spill to a temporary file
_PARQUET_BATCH_ROWS = 1024


def _iter_parquet(stream: BinaryIO, limits: InputLimits) -> Iterator[ParsedRequest | LineError]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("Parquet input needs pyarrow: pip install 'conveyor[parquet]'") from None
    # Parquet keeps its schema at the end of the file: spool the stream (bounded memory)
    # to read it with random access, batch by batch.
    with tempfile.SpooledTemporaryFile(max_size=_PARQUET_SPOOL_BYTES) as spool:
        total = 0
        while chunk := stream.read(1 << 20):
            total += len(chunk)
            if total > limits.max_input_bytes:
                raise InputTooLarge(f"input is larger than {limits.max_input_bytes} bytes (CONVEYOR_MAX_INPUT_BYTES)")
            spool.write(chunk)
        spool.seek(0)
        try:
            parquet = pq.ParquetFile(spool)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise InputError(f"cannot read the Parquet file: {exc}") from None
        columns = [name.lower() for name in parquet.schema_arrow.names]
        if "prompt" not in columns and "messages" not in columns:
            raise InputError(f"the Parquet file has no 'prompt' or 'messages' column (columns: {', '.join(columns)})")
        row = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for record in batch.to_pylist():
                row += 1
                if row > limits.max_lines:
                    raise InputTooLarge(f"input has more than {limits.max_lines} rows (CONVEYOR_MAX_LINES_PER_JOB)")
                obj = {k.lower(): v for k, v in record.items() if v is not None}
                size = len(json.dumps(obj, default=str).encode())
                if size > limits.max_line_bytes:
                    yield LineError(
                        row, "line_too_long", f"row is {size} bytes, more than {limits.max_line_bytes} (CONVEYOR_MAX_LINE_BYTES)"
                    )
                    continue
                try:
                    yield _request_from_object(obj, row, limits)
                except InvalidRequest as exc:
                    yield _error(row, exc, _guess_custom_id(obj))


def iter_input(
    stream: BinaryIO, limits: InputLimits, fmt: InputFormat | str = InputFormat.jsonl
) -> Iterator[ParsedRequest | LineError]:
    """Parse ``stream`` lazily: a ``ParsedRequest`` or ``LineError`` per non-blank line
    (per row for Parquet).

    Raises ``InputError``/``InputTooLarge`` for whole-file problems (during iteration).
    """
    readers = {InputFormat.csv: _iter_csv, InputFormat.parquet: _iter_parquet}
    rows = readers.get(InputFormat(fmt), _iter_jsonl)(stream, limits)
    ids = _Ids()
    for item in rows:
        # Rejected lines claim their custom_id too: a later line reusing it is a duplicate.
        dup = ids.check(item.custom_id, item.line) if item.custom_id is not None else None
        yield dup if dup is not None and isinstance(item, ParsedRequest) else item


# ---- errors-file line for a rejected input line --------------------------------------


def line_error_line(job_id: str, err: LineError) -> dict[str, Any]:
    """The errors-file line for an input line rejected at validation."""
    return error_line(job_id, err.custom_id, code=err.code, message=err.message, line=err.line, param=err.param)
