"""``conveyor run`` and ``submit`` exit non-zero, with a one-line reason, when no request
succeeded; ``--format`` forces the input format and otherwise the content decides."""

from __future__ import annotations

import io
import json

import pytest

from conveyor.worker.entrypoints.cli import main
from tests.worker.helpers import jsonl, openai_lines


def _run(stack, path, *extra: str) -> int:
    return main(["run", str(path), "--model", stack.model, "-q", *extra])


def _reason(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("conveyor: error:")]
    return line


@pytest.mark.parametrize(
    ("data", "why"),
    [
        # (refused before the model loads, so before any job: the reason alone)
        (b"", "conveyor: error: the input has no requests"),
        (b"\n \n", "conveyor: error: the input has no requests"),
        (bytes(range(256)) * 8, "conveyor: error: the input is not text"),
        (b'{"prompt": ""}\n{"nope": 1}\n[1]\n', "no request succeeded: all 3 lines were rejected"),
    ],
)
def test_run_fails_when_no_request_succeeded(embedded_stack, env, tmp_path, capsys, data: bytes, why: str) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    assert _run(stack, path, "--errors", str(tmp_path / "errors.jsonl")) == 1
    err = capsys.readouterr().err
    assert why in _reason(err) and "Traceback" not in err


def test_a_parquet_file_named_jsonl_runs_as_parquet(embedded_stack, env, tmp_path, capsys) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    stack = env(embedded_stack)
    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": ["Tea and", "Soup is"], "max_tokens": [2, 2]}), buf)
    path = tmp_path / "requests.jsonl"
    path.write_bytes(buf.getvalue())
    assert _run(stack, path) == 0
    assert [json.loads(line)["custom_id"] for line in capsys.readouterr().out.splitlines()] == ["line-1", "line-2"]
    assert _run(stack, path, "--format", "jsonl") == 1  # forced: refused, naming what it looks like
    assert "looks like Parquet" in _reason(capsys.readouterr().err)


def test_format_flag_forces_csv(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "rows.txt"
    path.write_bytes(b"text,prompt\nx,Warm bread\n")
    assert _run(stack, path, "--format", "csv") == 0
    assert json.loads(capsys.readouterr().out)["custom_id"] == "line-2"


def test_submit_refuses_an_empty_input_as_a_whole(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"\n")
    assert main(["submit", str(path), "--model", stack.model, "--json"]) == 1
    job = json.loads(capsys.readouterr().out)
    assert job["status"] == "failed" and "the input has no requests" in job["errors"]["data"][0]["message"]


def test_submit_fails_when_every_line_is_rejected(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"{oops\n" + jsonl(openai_lines(1))[:-3] + b"\n")
    assert main(["submit", str(path), "--model", stack.model, "--format", "jsonl"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("batch_")  # the job exists: its errors file tells what is wrong
    assert "all 2 lines were rejected" in _reason(err) and f"conveyor results {out.strip()} --errors" in err
