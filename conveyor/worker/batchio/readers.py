"""Reading a job's input file: its format (from its first bytes, then its name), then a
``ParsedRequest`` or a ``LineError`` per non-blank line, streamed (a whole file is never
held in memory).

A bad line never stops the rest: it becomes a ``LineError`` naming the line number and what
is wrong. Whole-file problems raise ``InputError``: over the size or line limit, a CSV header
without a prompt or messages column, a text format whose first bytes are not text, no request at all,
OpenAI Batch lines asking for different urls. A repeated ``custom_id`` is an error on the
later line. Blank lines are skipped and not counted.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Iterator

from conveyor.worker.batchio.csv_input import iter_csv
from conveyor.worker.batchio.jsonl_input import iter_jsonl
from conveyor.worker.batchio.line_reader import ByteStream
from conveyor.worker.batchio.parquet_input import iter_parquet
from conveyor.worker.batchio.peek import peek
from conveyor.worker.batchio.records import InputError, InputFormat, LineError, ParsedRequest
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import InputLimits

PARQUET_MAGIC = b"PAR1"
_BOM = b"\xef\xbb\xbf"
_TEXT_CONTROLS = frozenset(b"\t\n\r\x0b\x0c")

_WIDE = "it looks like UTF-16 or UTF-32 text; save it as UTF-8"
# First bytes of files that are not text, and what to do about each.
_MAGIC = {
    PARQUET_MAGIC: "it starts with PAR1 and looks like Parquet; use --format parquet",
    b"\x1f\x8b": "it looks gzip-compressed; decompress it first",
    b"PK\x03\x04": "it looks like a zip archive; unzip it first",
    b"\xff\xfe": _WIDE,  # byte order marks
    b"\xfe\xff": _WIDE,
}


def _first_line(head: bytes) -> bytes | None:
    """The first non-blank line of ``head`` (perhaps cut short), without a byte order mark."""
    for line in head.removeprefix(_BOM).split(b"\n"):
        if line.strip():
            return line.strip()
    return None


def _is_csv_header(line: bytes) -> bool:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    names = next(csv.reader([text]), [])
    return len(names) > 1 and bool({"prompt", "messages", "input"} & {name.strip().lower() for name in names})


def detect_format(filename: str, head: bytes = b"") -> InputFormat:
    """The input's format from its first bytes (``head``), then its name: Parquet when it
    starts with ``PAR1``; JSONL when its first non-blank line starts with ``{``; CSV for
    ``*.csv`` or a first line that is a CSV header with a ``prompt`` or ``messages`` column; Parquet for
    ``*.parquet``/``*.pq``; else JSONL (OpenAI Batch or plain, told apart per line)."""
    name = filename.lower()
    first = _first_line(head)
    if head.startswith(PARQUET_MAGIC):
        return InputFormat.parquet
    if first is not None and first.startswith(b"{"):
        return InputFormat.jsonl
    if name.endswith((".parquet", ".pq")):
        return InputFormat.parquet
    if name.endswith(".csv") or (first is not None and _is_csv_header(first)):
        return InputFormat.csv
    return InputFormat.jsonl


def _bad_bytes(head: bytes) -> int:
    """Bytes of ``head`` no text file has: NUL and other controls, and invalid UTF-8."""
    bad = sum(1 for b in head if b < 0x20 and b not in _TEXT_CONTROLS)
    rest = head
    while True:
        try:
            rest.decode("utf-8")
            return bad
        except UnicodeDecodeError as exc:
            if exc.end == len(rest) and exc.reason == "unexpected end of data":
                return bad  # a character cut by the end of the head
            bad += exc.end - exc.start
            rest = rest[exc.end :]


def check_text(head: bytes) -> None:
    """``InputError`` if the input whose first bytes are ``head`` is not text. A few bad
    bytes (one garbled line) are left to that line's error; binary data has many."""
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            raise InputError(f"the input is not text: {what}")
    if len(head) >= 8 and max(head[0::2].count(0), head[1::2].count(0)) > len(head) // 4:
        raise InputError(f"the input is not text: {_WIDE}")  # NUL in every other byte
    bad = _bad_bytes(head)
    if bad * 8 > len(head):
        raise InputError(
            f"the input is not text: {bad} of its first {len(head)} bytes are NUL, control or non-UTF-8 bytes "
            "(binary data?); give UTF-8 JSONL or CSV, or use --format parquet for Parquet"
        )


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


def iter_input(
    stream: ByteStream,
    limits: InputLimits,
    fmt: InputFormat | str = InputFormat.jsonl,
    options: RequestOptions | None = None,
) -> Iterator[ParsedRequest | LineError]:
    """Parse ``stream`` lazily: a ``ParsedRequest`` or ``LineError`` per non-blank line
    (per row for Parquet); ``options``: the job's request options, applied to every line.

    Raises ``InputError``/``InputTooLarge`` for whole-file problems (during iteration).
    """
    fmt = InputFormat(fmt)
    if fmt is not InputFormat.parquet:
        head, stream = peek(stream)
        check_text(head)
    readers = {InputFormat.csv: iter_csv, InputFormat.parquet: iter_parquet}
    rows = readers.get(fmt, iter_jsonl)(stream, limits, options or RequestOptions())
    ids = _Ids()
    count = 0
    for item in rows:
        count += 1
        # Rejected lines claim their custom_id too: a later line reusing it is a duplicate.
        dup = ids.check(item.custom_id, item.line) if item.custom_id is not None else None
        yield dup if dup is not None and isinstance(item, ParsedRequest) else item
    if not count:
        raise InputError("the input has no requests: it is empty, blank, or a header without rows")
