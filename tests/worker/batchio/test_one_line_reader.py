"""The upload's scan and intake read a JSONL file's lines through one reader: the lines the
scan charges are the lines intake runs or rejects, whatever the byte order mark, line endings,
blank and over-long lines, and however the upload's bytes were chunked."""

from __future__ import annotations

import io
import json

import pytest

from conveyor.worker.batchio.batch_scan import BatchScanner
from conveyor.worker.batchio.line_reader import LineReader, LineSplitter
from conveyor.worker.batchio.readers import iter_input
from conveyor.worker.batchio.records import LineError, ParsedRequest
from conveyor.worker.core.limits import InputLimits

LIMITS = InputLimits(max_line_bytes=200, max_lines=1000, max_input_bytes=1 << 20)


def line(i: int, model: str = "m", max_tokens: int = 5) -> bytes:
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": f"hi {i}"}]}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()


FILES = {
    "bom first line": b"\xef\xbb\xbf" + line(1, "bom") + b"\n" + line(2) + b"\n",
    "crlf, blank lines, no final newline": line(1) + b"\r\n\r\n  \n" + line(2) + b"\r\n" + line(3),
    "over-long lines": line(1) + b"\n" + b"x" * 201 + b"\n" + b"y" * 200 + b"\r\n" + b"z" * 5000,
    "a bom alone on line 1, a bom on line 2": b"\xef\xbb\xbf\n\xef\xbb\xbf" + line(2) + b"\n",
    "not json and a plain row": b"{nope\n" + b'{"prompt": "hi"}\n' + line(3) + b"\n",
}


def scanned(data: bytes, chunk: int):
    scanner = BatchScanner(LIMITS.max_line_bytes)
    for start in range(0, len(data), chunk):
        scanner.feed(data[start : start + chunk])
    return scanner.finish()


def intake_lines(data: bytes) -> dict[int, ParsedRequest | LineError]:
    return {entry.line: entry for entry in iter_input(io.BytesIO(data), LIMITS)}


@pytest.mark.parametrize("name", FILES)
def test_the_scan_counts_every_line_intake_reads(name: str) -> None:
    data = FILES[name]
    read = intake_lines(data)
    for chunk in (1, 3, 64, len(data)):
        scan = scanned(data, chunk)
        assert scan.lines == len(read), (chunk, scan, read)
        # Every line is charged: those naming max_tokens their 5, the others the default.
        ran = [e for e in read.values() if isinstance(e, ParsedRequest)]
        assert scan.requested_tokens + scan.default_token_samples * 100 >= sum(5 for _ in ran)
        assert scan.output_tokens(100) >= 5 * len(ran)


def test_a_bom_first_line_is_charged_and_run_alike() -> None:
    data = FILES["bom first line"]
    read = intake_lines(data)
    assert isinstance(read[1], ParsedRequest) and read[1].custom_id == "r1"
    scan = scanned(data, 7)
    assert scan.models == ["bom", "m"] and scan.not_json == 0
    assert scan.requested_tokens == 10  # both lines' max_tokens, the BOM'd one included
    # A BOM is dropped from line 1 only: on line 2 it is not JSON, for both.
    data = FILES["a bom alone on line 1, a bom on line 2"]
    assert isinstance(intake_lines(data)[2], LineError)
    assert scanned(data, 5).not_json == 1


def test_lines_are_split_the_same_pulled_or_pushed() -> None:
    data = b"".join(FILES.values())
    pulled = list(LineReader(io.BytesIO(data), LIMITS))
    for chunk in (1, 2, 199, 203, 4096):
        splitter = LineSplitter(LIMITS.max_line_bytes)
        pushed = [x for start in range(0, len(data), chunk) for x in splitter.feed(data[start : start + chunk])]
        assert pushed + list(splitter.finish()) == pulled
    long_lines = LineReader(io.BytesIO(FILES["over-long lines"]), LIMITS)
    assert [n for n, raw in long_lines if raw is None] == [2, 4]  # 201 bytes and 5000; 200 + "\r\n" fit


def test_an_api_batch_takes_only_lines_to_its_endpoint() -> None:
    from conveyor.worker.batchio.request_options import RequestOptions

    rows = [
        line(1),
        {"custom_id": "plain-prompt", "prompt": "hi"},
        {"id": "plain-input", "input": "embed me"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}},
        {"custom_id": "url-column", "url": "/v1/chat/completions", "prompt": "hi"},
        {"custom_id": "odd-url", "method": "POST", "url": 5, "body": {"model": "m", "prompt": "x"}},
    ]
    data = b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows)
    read = list(iter_input(io.BytesIO(data), LIMITS, options=RequestOptions(endpoint="/v1/chat/completions")))
    assert isinstance(read[0], ParsedRequest) and read[0].endpoint == "/v1/chat/completions"
    errors = read[1:]
    assert all(isinstance(e, LineError) for e in errors), errors
    assert [(e.custom_id, e.code) for e in errors] == [  # type: ignore[union-attr]
        ("plain-prompt", "url_mismatch"), ("plain-input", "url_mismatch"), (None, "url_mismatch"),
        ("emb", "url_mismatch"), ("url-column", "missing_prompt"), ("odd-url", "url_mismatch"),
    ]  # fmt: skip
    assert "plain dataset row" in errors[0].message and "/v1/chat/completions" in errors[0].message  # type: ignore[union-attr]
    assert "/v1/embeddings" in errors[3].message  # type: ignore[union-attr]
    # Without an endpoint (the CLI, the broker) plain rows run, each as what it is.
    plain = list(iter_input(io.BytesIO(data), LIMITS))
    assert [type(e).__name__ for e in plain[1:4]] == ["ParsedRequest"] * 3
