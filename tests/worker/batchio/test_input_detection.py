"""The input's format from its content as well as its name, on streams that cannot seek, and
inputs refused as a whole: not text, or nothing in them."""

from __future__ import annotations

import io
import random

import pytest

from conveyor.worker.batchio.readers import detect_format, iter_input, peek
from conveyor.worker.batchio.records import InputError, InputFormat, LineError, ParsedRequest
from conveyor.worker.core.limits import InputLimits

LIMITS = InputLimits()


class Pipe:
    """A stream that cannot seek or be read twice, like stdin or an HTTP body."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)

    def read(self, size: int = -1, /) -> bytes:
        return self._f.read(size if size < 0 else min(size, 7))  # short reads, as pipes do

    def readline(self, size: int = -1, /) -> bytes:
        return self._f.readline(size)


@pytest.mark.parametrize(
    ("name", "head", "expected"),
    [
        ("requests.jsonl", b"PAR1\x15\x04", InputFormat.parquet),  # Parquet named .jsonl
        ("data", b"PAR1", InputFormat.parquet),
        ("rows.parquet", b"", InputFormat.parquet),
        ("rows.csv", b'\xef\xbb\xbf\n  \n{"prompt": "a"}\n', InputFormat.jsonl),  # JSONL named .csv
        ("rows.csv", b"prompt,custom_id\nhi,1\n", InputFormat.csv),
        ("rows.txt", b"Prompt, custom_id\nhi,1\n", InputFormat.csv),  # a CSV header, whatever the name
        ("rows.jsonl", b"prompt,id\nhi,1\n", InputFormat.csv),
        ("rows.jsonl", b"prompt\nhi\n", InputFormat.jsonl),  # one word is not a CSV header
        ("rows.jsonl", b"{oops\n", InputFormat.jsonl),
        ("input.jsonl", b"", InputFormat.jsonl),
    ],
)
def test_format_from_content_then_name(name: str, head: bytes, expected: InputFormat) -> None:
    assert detect_format(name, head) is expected


def test_peeking_replays_the_head_on_a_stream_that_cannot_seek() -> None:
    data = b"".join(b'{"prompt": "line %d"}\n' % i for i in range(300))  # longer than the head
    head, stream = peek(Pipe(data))
    assert data.startswith(head) and 0 < len(head) <= 1024
    assert stream.readline(5) == data[:5] and stream.readline() == data[5 : data.index(b"\n") + 1]
    rest = b""
    while chunk := stream.read(100):
        rest += chunk
    assert data[: data.index(b"\n") + 1] + rest == data
    entries = list(iter_input(peek(Pipe(data))[1], LIMITS))
    assert [e.line for e in entries] == list(range(1, 301)) and all(isinstance(e, ParsedRequest) for e in entries)


def _refusal(data: bytes, fmt: str = "jsonl") -> str:
    with pytest.raises(InputError) as info:
        list(iter_input(Pipe(data), LIMITS, fmt))
    return str(info.value)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_binary_input_is_refused_as_a_whole(fmt: str) -> None:
    noise = random.Random(4).randbytes(4096)
    assert "the input is not text" in _refusal(noise, fmt) and "--format" in _refusal(noise, fmt)
    assert "looks like Parquet" in _refusal(b"PAR1" + noise, fmt)
    assert "UTF-16" in _refusal('{"prompt": "hi"}\n'.encode("utf-16"), fmt)
    assert "gzip" in _refusal(b"\x1f\x8b\x08\x00" + noise, fmt)


def test_a_few_bad_bytes_in_text_stay_line_errors() -> None:
    data = b'{"prompt": "a"}\n{"prompt": "\x00\xff"}\n\x00\x01\x02\n' + b'{"prompt": "b"}\n' * 20
    entries = list(iter_input(Pipe(data), LIMITS))
    assert len(entries) == 23 and [e.line for e in entries if isinstance(e, LineError)] == [2, 3]


@pytest.mark.parametrize(
    ("data", "fmt"),
    [(b"", "jsonl"), (b"\n  \r\n\t\n", "jsonl"), (b"\xef\xbb\xbf", "jsonl"), (b"prompt,id\n\n", "csv")],
)
def test_an_input_without_requests_is_refused_as_a_whole(data: bytes, fmt: str) -> None:
    assert "the input has no requests" in _refusal(data, fmt)
