"""Physical lines of an input stream under the size limits, in bounded memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from conveyor.worker.batchio.records import InputTooLarge, LineError
from conveyor.worker.core.limits import InputLimits

_SKIP_CHUNK = 64 * 1024


class ByteStream(Protocol):
    """What the readers need of an input: a binary file, or a tee that copies what is read."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readline(self, size: int = -1, /) -> bytes: ...


class LineReader:
    """Physical lines of a binary stream as ``(line_no, bytes | None)``; None = too long.

    Enforces ``max_input_bytes`` and ``max_line_bytes`` (the newline not counted) while
    reading, so memory stays at one line whatever the file.
    """

    def __init__(self, stream: ByteStream, limits: InputLimits) -> None:
        self._stream, self._limits = stream, limits
        self.line_no = 0
        self._total = 0

    def _count(self, n: int) -> None:
        self._total += n
        if self._total > self._limits.max_input_bytes:
            raise too_big(self._limits)

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


def too_long(line: int, limits: InputLimits) -> LineError:
    return LineError(
        line, "line_too_long", f"line is longer than {limits.max_line_bytes} bytes (CONVEYOR_MAX_LINE_BYTES)"
    )


def too_many(limits: InputLimits, what: str = "lines") -> InputTooLarge:
    return InputTooLarge(f"input has more than {limits.max_lines} {what} (CONVEYOR_MAX_LINES_PER_JOB)")


def too_big(limits: InputLimits) -> InputTooLarge:
    return InputTooLarge(f"input is larger than {limits.max_input_bytes} bytes (CONVEYOR_MAX_INPUT_BYTES)")
