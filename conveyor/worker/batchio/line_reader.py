"""Physical lines of an input under the size limits, in bounded memory: the one reader of
input lines, whether the bytes are pulled from a stream (intake, ``LineReader``) or pushed as
they arrive (an upload's scan, ``LineSplitter``), so that both see the same lines.

``jsonl_lines`` is how a JSONL input's lines are read by both: a UTF-8 byte order mark in
front of line 1 is dropped, a line ends at ``\\n`` (a ``\\r`` before it is whitespace), blank
lines are skipped but numbered, and a line over ``max_line_bytes`` (its line ending not
counted) is ``None``: one line error, never held in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from conveyor.worker.batchio.records import InputTooLarge, LineError
from conveyor.worker.core.limits import InputLimits

BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark
_READ_CHUNK = 64 * 1024

Line = tuple[int, bytes | None]  # (1-based line number, its bytes with the newline, or None: too long)


class ByteStream(Protocol):
    """What the readers need of an input: a binary file, or a tee that copies what is read."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readline(self, size: int = -1, /) -> bytes: ...


class LineSplitter:
    """Physical lines of bytes fed in any chunking (``feed``, then ``finish``), each with its
    newline; a line longer than ``max_line_bytes`` (``\\r\\n`` not counted) is ``None`` and only
    ``max_line_bytes + 2`` bytes of it are ever held."""

    def __init__(self, max_line_bytes: int) -> None:
        self._limit = max_line_bytes
        self._partial = bytearray()
        self._skipping = False  # inside a line already too long
        self.line_no = 0

    def feed(self, data: bytes) -> Iterator[Line]:
        start, size = 0, len(data)
        while start < size:
            end = data.find(b"\n", start) + 1
            if not end:
                self._hold(data, start, size)
                return
            if self._partial or self._skipping:
                self._hold(data, start, end)
                yield self._take()
            elif end - start > self._limit + 2:  # a whole line in this chunk, too long
                self.line_no += 1
                yield self.line_no, None
            else:  # a whole line in this chunk
                yield self._line(data[start:end])
            start = end

    def finish(self) -> Iterator[Line]:
        """The last line, when the input does not end with a newline."""
        if self._partial or self._skipping:
            yield self._take()

    def _hold(self, data: bytes, start: int, end: int) -> None:
        if self._skipping:
            return
        if len(self._partial) + (end - start) > self._limit + 2:  # room for "\r\n"
            self._partial.clear()
            self._skipping = True
            return
        self._partial += data[start:end]

    def _take(self) -> Line:
        if self._skipping:
            self._skipping = False
            self.line_no += 1
            return self.line_no, None
        raw = bytes(self._partial)
        self._partial.clear()
        return self._line(raw)

    def _line(self, raw: bytes) -> Line:
        self.line_no += 1
        if len(raw) > self._limit and len(raw.rstrip(b"\r\n")) > self._limit:
            return self.line_no, None
        return self.line_no, raw


class LineReader:
    """Physical lines of a binary stream as ``(line_no, bytes | None)``; None = too long.

    Enforces ``max_input_bytes`` and ``max_line_bytes`` (the newline not counted) while
    reading, so memory stays at one line whatever the file.
    """

    def __init__(self, stream: ByteStream, limits: InputLimits) -> None:
        self._stream, self._limits = stream, limits
        self._splitter = LineSplitter(limits.max_line_bytes)
        self._total = 0

    @property
    def line_no(self) -> int:
        return self._splitter.line_no

    def __iter__(self) -> Iterator[Line]:
        while True:
            data = self._stream.read(_READ_CHUNK)
            if not data:
                break
            self._total += len(data)
            if self._total > self._limits.max_input_bytes:
                raise too_big(self._limits)
            yield from self._splitter.feed(data)
        yield from self._splitter.finish()


def jsonl_lines(lines: Iterable[Line]) -> Iterator[Line]:
    """The lines of a JSONL input as intake and the upload's scan both read them: line 1
    without a byte order mark, blank lines skipped (their numbers kept), None = too long."""
    for line_no, raw in lines:
        if raw is not None:
            if line_no == 1:
                raw = raw.removeprefix(BOM)
            if not raw.strip():
                continue
        yield line_no, raw


def too_long(line: int, limits: InputLimits) -> LineError:
    return LineError(
        line, "line_too_long", f"line is longer than {limits.max_line_bytes} bytes (CONVEYOR_MAX_LINE_BYTES)"
    )


def too_many(limits: InputLimits, what: str = "lines") -> InputTooLarge:
    return InputTooLarge(f"input has more than {limits.max_lines} {what} (CONVEYOR_MAX_LINES_PER_JOB)")


def too_big(limits: InputLimits) -> InputTooLarge:
    return InputTooLarge(f"input is larger than {limits.max_input_bytes} bytes (CONVEYOR_MAX_INPUT_BYTES)")
