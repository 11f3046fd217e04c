"""Parquet input: a prompt (or messages) column, rows numbered like lines, same validation."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from conveyor.worker.batchio.readers import detect_format, iter_input
from conveyor.worker.batchio.records import InputError, InputFormat, LineError, ParsedRequest
from conveyor.worker.core.limits import InputLimits
from conveyor.worker.entrypoints.cli import main
from tests.worker.helpers import as_request

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _parquet(table: dict) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table(table), buf, row_group_size=2)  # several row groups
    return buf.getvalue()


ROWS = {
    "custom_id": ["a", "b", "c", "a", None],
    "prompt": ["Tea and cake", "The chef will bring", None, "dup", "Warm bread"],
    "max_tokens": [4, -1, 3, 3, 5],
    "temperature": [0.0, 0.0, 0.0, 0.0, 0.5],
}


def test_rows_become_requests_or_numbered_errors():
    entries = list(iter_input(io.BytesIO(_parquet(ROWS)), InputLimits(), InputFormat.parquet))
    assert [type(e).__name__ for e in entries] == [
        "ParsedRequest",
        "LineError",
        "LineError",
        "LineError",
        "ParsedRequest",
    ]
    first, last = entries[0], entries[4]
    assert isinstance(first, ParsedRequest) and first.line == 1 and first.custom_id == "a"
    assert first.prompt == "Tea and cake" and first.sampling["max_tokens"] == 4
    assert isinstance(last, ParsedRequest) and last.line == 5 and last.sampling["temperature"] == 0.5
    bad_value, no_prompt, duplicate = entries[1], entries[2], entries[3]
    assert isinstance(bad_value, LineError) and bad_value.line == 2 and "max_tokens" in bad_value.message
    assert no_prompt.line == 3 and duplicate.line == 4
    assert isinstance(duplicate, LineError) and duplicate.code == "duplicate_custom_id"


def test_messages_column_and_file_level_errors():
    table = {"messages": [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Soup?"}]]}
    entries = list(iter_input(io.BytesIO(_parquet(table)), InputLimits(), InputFormat.parquet))
    assert [as_request(e).messages for e in entries] == table["messages"]
    with pytest.raises(InputError, match="no 'prompt', 'messages' or 'input' column"):
        list(iter_input(io.BytesIO(_parquet({"text": ["x"]})), InputLimits(), InputFormat.parquet))
    with pytest.raises(InputError, match="cannot read the Parquet file"):
        list(iter_input(io.BytesIO(b"not parquet at all"), InputLimits(), InputFormat.parquet))
    small = dataclasses.replace(InputLimits(), max_lines=3)
    with pytest.raises(InputError, match="more than 3 rows"):
        list(iter_input(io.BytesIO(_parquet({"prompt": ["a", "b", "c", "d"]})), small, InputFormat.parquet))
    assert detect_format("data.PARQUET") is InputFormat.parquet and detect_format("x.pq") is InputFormat.parquet


def test_a_row_pyarrow_cannot_convert_is_one_error_naming_the_column():
    text = pa.array([b"Soup", b"\xff\xfe", b"Tea", b"Cake"], pa.binary()).view(pa.string())  # row 2: not UTF-8
    when = pa.array([0, 5, 10**15, 7], pa.timestamp("s"))  # row 3: past year 9999
    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": text, "when": when}), buf)
    entries = list(iter_input(io.BytesIO(buf.getvalue()), InputLimits(), InputFormat.parquet))
    assert [as_request(e).prompt for e in (entries[0], entries[3])] == ["Soup", "Cake"]
    bad_text, bad_time = entries[1], entries[2]
    assert isinstance(bad_text, LineError) and bad_text.line == 2 and "column 'prompt'" in bad_text.message
    assert isinstance(bad_time, LineError) and bad_time.line == 3 and "column 'when'" in bad_time.message


def test_a_parquet_job_end_to_end(embedded_stack, env, tmp_path):
    stack = env(embedded_stack)
    path = tmp_path / "requests.parquet"
    path.write_bytes(_parquet(ROWS))
    out, err = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    assert main(["run", str(path), "--model", stack.model, "-o", str(out), "--errors", str(err), "-q"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [json.loads(line) for line in err.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "line-5"]
    assert sorted(e["error"]["line"] for e in errors) == [2, 3, 4]
