"""Parquet input: a prompt (or messages) column, rows numbered like lines, same validation."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tests.worker.test_cli import env  # noqa: E402,F401 - the CLI's environment fixture
from worker.cli import main  # noqa: E402
from worker.formats import InputError, InputFormat, LineError, ParsedRequest, detect_format, iter_input  # noqa: E402
from worker.settings import InputLimits  # noqa: E402


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
    assert [type(e).__name__ for e in entries] == ["ParsedRequest", "LineError", "LineError", "LineError", "ParsedRequest"]
    first, last = entries[0], entries[4]
    assert isinstance(first, ParsedRequest) and first.line == 1 and first.custom_id == "a"
    assert first.prompt == "Tea and cake" and first.sampling["max_tokens"] == 4
    assert isinstance(last, ParsedRequest) and last.line == 5 and last.sampling["temperature"] == 0.5
    bad_value, no_prompt, duplicate = entries[1], entries[2], entries[3]
    assert isinstance(bad_value, LineError) and bad_value.line == 2 and "max_tokens" in bad_value.message
    assert no_prompt.line == 3 and duplicate.line == 4 and duplicate.code == "duplicate_custom_id"


def test_messages_column_and_file_level_errors():
    table = {"messages": [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Soup?"}]]}
    entries = list(iter_input(io.BytesIO(_parquet(table)), InputLimits(), InputFormat.parquet))
    assert [e.messages for e in entries] == table["messages"]
    with pytest.raises(InputError, match="no 'prompt' or 'messages' column"):
        list(iter_input(io.BytesIO(_parquet({"text": ["x"]})), InputLimits(), InputFormat.parquet))
    with pytest.raises(InputError, match="cannot read the Parquet file"):
        list(iter_input(io.BytesIO(b"not parquet at all"), InputLimits(), InputFormat.parquet))
    small = dataclasses.replace(InputLimits(), max_lines=3)
    with pytest.raises(InputError, match="more than 3 rows"):
        list(iter_input(io.BytesIO(_parquet({"prompt": ["a", "b", "c", "d"]})), small, InputFormat.parquet))
    assert detect_format("data.PARQUET") is InputFormat.parquet and detect_format("x.pq") is InputFormat.parquet


def test_a_parquet_job_end_to_end(embedded_stack, env, tmp_path):  # noqa: F811
    stack = env(embedded_stack)
    path = tmp_path / "requests.parquet"
    path.write_bytes(_parquet(ROWS))
    out, err = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    assert main(["run", str(path), "--model", stack.model, "-o", str(out), "--errors", str(err), "-q"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [json.loads(line) for line in err.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "line-5"]
    assert sorted(e["error"]["line"] for e in errors) == [2, 3, 4]
