"""Hostile input lines (huge numbers, deep nesting, lone surrogates, garbage): each one ends
as exactly one ``LineError`` with its line number and the field named, never an exception."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.worker.batchio.output_lines import dumps_line, line_error_line
from conveyor.worker.batchio.readers import iter_input
from conveyor.worker.batchio.records import LineError, ParsedRequest
from conveyor.worker.core.limits import InputLimits
from tests.worker.fuzz_lines import FIELDS, json_text

LIMITS = InputLimits(max_line_bytes=64 * 1024, max_lines=10_000, max_input_bytes=16 << 20)
HUGE = "9" * 5000  # over Python's 4,300-digit int-string limit
BIG = "9" * 400  # an int, but too big for a float


def _one(raw: bytes, fmt: str = "jsonl") -> LineError:
    """The single entry parsed from ``raw``, checked to be a rejected line."""
    (entry,) = list(iter_input(io.BytesIO(raw), LIMITS, fmt))
    assert isinstance(entry, LineError), entry
    dumps_line(line_error_line("batch_x", entry))  # the errors file can hold it
    return entry


@pytest.mark.parametrize(
    ("line", "param", "words"),
    [
        (f'{{"prompt": "p", "max_tokens": {HUGE}}}', "max_tokens", "an integer of 5000 digits"),
        (f'{{"prompt": "p", "seed": -{HUGE}}}', "seed", "an integer of 5000 digits"),
        (f'{{"prompt": [1, {HUGE}]}}', "prompt", "token ids"),
        (f'{{"prompt": "p", "top_p": {BIG}}}', "top_p", "top_p must be a number"),
        (f'{{"prompt": "p", "temperature": -{BIG}}}', "temperature", "temperature must be a number"),
        (f'{{"prompt": "p", "top_p": {HUGE}}}', "top_p", "an integer of 5000 digits"),
        ('{"prompt": "\\ud800 soup"}', "prompt", "lone surrogate"),
        ('{"prompt": ["\\udfff"]}', "prompt", "lone surrogate"),
        ('{"messages": [{"role": "user", "content": "a\\udc00"}]}', "messages[0].content", "lone surrogate"),
        (
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "messages[0].content[0].text",
            "lone surrogate",
        ),
        ('{"prompt": "p", "stop": ["ok", "\\ud834"]}', "stop", "lone surrogate"),
        ('{"custom_id": "\\ud800", "prompt": "p"}', "custom_id", "lone surrogates"),
    ],
)
def test_a_hostile_jsonl_line_is_one_error_naming_the_field(line: str, param: str, words: str) -> None:
    err = _one(line.encode() + b"\n")
    assert err.line == 1 and err.param == param and words in err.message, err


@pytest.mark.parametrize("field", ["top_p", "max_tokens", "stop", "prompt", "method", "stream"])
def test_nesting_at_any_depth_is_one_error(field: str) -> None:
    # Python's recursion limit is shared by the JSON parser and whatever later looks at the
    # value (repr in an error message): every depth around that limit must end as one error.
    for depth in range(900, 1100):
        nest = "[" * depth + "]" * depth
        if field in ("method", "stream"):
            body = f'{{"prompt": "p", "stream": {nest}}}' if field == "stream" else "{}"
            method = nest if field == "method" else '"POST"'
            line = f'{{"custom_id": "r", "method": {method}, "url": "/v1/completions", "body": {body}}}'
        else:
            line = f'{{"prompt": "p", "{field}": {nest}}}'
        err = _one(line.encode() + b"\n")
        assert err.param == field or err.code == "invalid_json", (depth, err)


@pytest.mark.parametrize(
    ("cell", "param", "words"),
    [
        (HUGE, "max_tokens", "an integer of 5000 digits"),
        (BIG, "top_p", "top_p must be a number"),
        ('"[""\\ud800""]"', "stop", "lone surrogate"),
    ],
)
def test_a_hostile_csv_cell_is_one_error_naming_the_field(cell: str, param: str, words: str) -> None:
    err = _one(f"prompt,{param}\nhello,{cell}\n".encode(), "csv")
    assert err.line == 2 and err.param == param and words in err.message, err


def test_a_huge_number_in_an_ignored_field_loses_nothing() -> None:
    (entry,) = list(iter_input(io.BytesIO(b'{"prompt": "p", "label": %s}\n' % HUGE.encode()), LIMITS))
    assert isinstance(entry, ParsedRequest) and entry.prompt == "p"


# ---- the reader as a whole, on arbitrary lines ------------------------------------------------

_garbage = st.one_of(
    st.binary(max_size=200),
    json_text(),
    st.dictionaries(st.sampled_from(FIELDS), json_text(), max_size=6).map(
        lambda d: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in d.items()) + "}"
    ),
)


def _as_line(value: str | bytes) -> bytes:
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    return raw.replace(b"\n", b" ")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_garbage, min_size=1, max_size=12))
def test_every_non_blank_line_ends_as_exactly_one_entry(lines: list[str | bytes]) -> None:
    # A first line of plain text fills the bytes read to tell text from binary: past it,
    # even runs of random bytes are lines to reject one by one.
    raws = [b'{"prompt": "' + b"x" * 1100 + b'"}'] + [_as_line(v) for v in lines]
    expected = [n for n, raw in enumerate(raws, 1) if raw.strip()]
    entries = list(iter_input(io.BytesIO(b"\n".join(raws) + b"\n"), LIMITS))
    assert [e.line for e in entries] == expected
    for entry in entries:
        if isinstance(entry, LineError):
            dumps_line(line_error_line("batch_x", entry))


_cell = st.one_of(st.sampled_from([20, 310, 4300, 4301, 6000]).map(lambda n: "9" * n), json_text(max_leaves=4))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.lists(_cell, min_size=3, max_size=3), min_size=1, max_size=8))
def test_every_csv_row_ends_as_exactly_one_entry(rows: list[list[str]]) -> None:
    import csv

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["prompt", "top_p", "notes"])
    writer.writerows(rows)
    data = buf.getvalue().encode("utf-8", "surrogatepass")
    limits = dataclasses.replace(LIMITS, max_line_bytes=1 << 20)
    entries = list(iter_input(io.BytesIO(data), limits, "csv"))
    assert len(entries) == sum(1 for row in rows if any(cell.strip() for cell in row))
    assert all(a.line < b.line for a, b in itertools.pairwise(entries))
