"""``conveyor run`` refuses an input whose start shows it cannot be a job (a CSV or Parquet
header without a prompt, messages or input column; no request at all) before it loads the
model: no engine is built and no job is created."""

from __future__ import annotations

import json

import pytest

from conveyor.worker.entrypoints.cli import main
from tests.worker.helpers import record_engine_builds


def _refused_before_loading(stack, src, monkeypatch, capsys) -> str:
    built = record_engine_builds(monkeypatch)
    assert main(["run", str(src), "--model", stack.model, "-q"]) == 1
    assert built == []  # the model never loaded
    err = capsys.readouterr().err
    assert "loading model" not in err
    assert main(["jobs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"] == []  # and no job exists
    return err


def test_a_csv_header_without_a_prompt_column(embedded_stack, env, tmp_path, monkeypatch, capsys):
    stack = env(embedded_stack)
    src = tmp_path / "rows.csv"
    src.write_text("id,question\n1,What is the capital of France?\n")
    err = _refused_before_loading(stack, src, monkeypatch, capsys)
    assert "the CSV header has no 'prompt', 'messages' or 'input' column (columns: id, question)" in err


def test_a_parquet_file_without_a_prompt_column(embedded_stack, env, tmp_path, monkeypatch, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    stack = env(embedded_stack)
    src = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), src)
    err = _refused_before_loading(stack, src, monkeypatch, capsys)
    assert "the Parquet file has no 'prompt', 'messages' or 'input' column (columns: id, text)" in err


def test_an_input_with_no_request(embedded_stack, env, tmp_path, monkeypatch, capsys):
    stack = env(embedded_stack)
    src = tmp_path / "empty.csv"
    src.write_text("custom_id,prompt\n")
    err = _refused_before_loading(stack, src, monkeypatch, capsys)
    assert "the input has no requests" in err


def test_a_good_header_still_runs(embedded_stack, env, tmp_path, monkeypatch, capsys):
    stack = env(embedded_stack)
    built = record_engine_builds(monkeypatch)
    src, out = tmp_path / "rows.csv", tmp_path / "out.jsonl"
    src.write_text("custom_id,prompt,max_tokens\na,one two,3\nb,three four,3\n")
    assert main(["run", str(src), "--model", stack.model, "-q", "-o", str(out)]) == 0
    assert len(built) == 1
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == ["a", "b"]
