"""What ``conveyor run`` says at the end (one short line, and why requests failed), the model
name results carry (the job's, as submitted), and ``--concurrency``'s help (shards)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conveyor.worker.batchio.error_summary import summarize_failures
from conveyor.worker.batchio.output_lines import dumps_line, error_line, failed_request_line
from conveyor.worker.entrypoints.cli import main
from tests.worker.helpers import REPO, parse_lines

EXAMPLE = str(REPO / "examples" / "requests.jsonl")


def test_run_ends_with_a_short_summary_and_why_requests_failed(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    out, err = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    assert main(["run", EXAMPLE, "--model", stack.model, "-o", str(out), "--errors", str(err), "-q"]) == 0
    summary, why = capsys.readouterr().err.strip().splitlines()[-2:]
    assert summary.startswith("batch_") and " completed in " in summary  # the job id first, as before
    assert summary.endswith(f"6 completed, 2 failed of 8; results in {out}, errors in {err}")
    assert "file://" not in summary and len(summary) - len(str(out)) - len(str(err)) < 120
    assert why == (
        "conveyor: why they failed: 1 invalid_value (line 7: max_tokens must be an integer from 1 to 32768, got -5); "
        "1 invalid_json (line 8: invalid JSON: Expecting ',' delimiter at column 1)"
    )


def test_run_to_stdout_without_an_errors_file_says_where_the_errors_are(embedded_stack, env, capsys) -> None:
    stack = env(embedded_stack)
    assert main(["run", EXAMPLE, "--model", stack.model, "-q"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-2]
    assert summary.endswith("6 completed, 2 failed of 8; results in stdout, errors: --errors FILE")


def test_results_name_the_model_as_the_job_did(embedded_stack, env, tmp_path, monkeypatch, capsys) -> None:
    stack = env(embedded_stack)
    model = Path(stack.model)
    monkeypatch.chdir(model.parent)
    relative = f"./{model.name}"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Bring the bread", "max_tokens": 2}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", str(rows), "--model", relative, "-o", str(out), "-q"]) == 0
    (result,) = parse_lines(out.read_text().splitlines())
    assert result["response"]["body"]["model"] == relative  # not the absolute checkpoint path
    assert main(["jobs", "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["data"]
    assert job["model"] == str(model.resolve())  # the job itself keeps the canonical id (queues, workers)


@pytest.mark.parametrize("command", ["run", "worker"])
def test_concurrency_help_says_it_counts_shards(command: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--concurrency SHARDS shard" in text and "not requests" in text


def test_failures_are_grouped_by_code_most_frequent_first() -> None:
    lines = [
        dumps_line(error_line("j", None, code="invalid_json", message="invalid JSON: oops", line=3)),
        dumps_line(failed_request_line("j", "a", status_code=400, code="invalid_request", message="x" * 200, line=4)),
        dumps_line(failed_request_line("j", "b", status_code=400, code="invalid_request", message="y", line=5)),
        dumps_line(error_line("j", "c", code="batch_expired", message="expired", line=6)),
        dumps_line(error_line("j", "d", code="worker_crashed", message="crashed", line=7)),
    ]
    kinds, others = summarize_failures(lines, kinds=3)
    assert [(k.code, k.count, k.where) for k in kinds] == [
        ("invalid_request", 2, "'a'"), ("invalid_json", 1, "line 3"), ("batch_expired", 1, "line 6"),
    ]  # fmt: skip
    assert others == 1 and kinds[0].message == "x" * 87 + "..."
    assert kinds[1].describe() == "1 invalid_json (line 3: invalid JSON: oops)"


HOSTILE = "\x1b]0;owned\x07\x1b[2J\x9b31m"


def _no_controls(text: str) -> None:
    assert not any(c in text for c in "\x1b\x07\x9b"), text


def test_custom_ids_reach_the_terminal_escaped(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack, engine_args={"num_kv_blocks": 256, "max_model_len": 48})
    rows = tmp_path / "rows.jsonl"
    chat = "/v1/chat/completions"
    good = {"messages": [{"role": "user", "content": "Bring the bread"}], "max_tokens": 2}
    too_long = {"messages": [{"role": "user", "content": "soup " * 80}], "max_tokens": 2}  # the engine refuses it
    lines = [{"custom_id": HOSTILE, "method": "POST", "url": chat, "body": good},
             {"custom_id": HOSTILE + "long", "method": "POST", "url": chat, "body": too_long}]  # fmt: skip
    rows.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", str(rows), "--model", stack.model, "-q", "-o", str(tmp_path / "out.jsonl")]) == 0
    why = capsys.readouterr().err.strip().splitlines()[-1]
    assert why.startswith("conveyor: why they failed: 1 ")
    assert "('\\x1b]0;owned\\x07\\x1b[2J\\x9b31mlong':" in why
    _no_controls(why)
    assert main(["jobs", "--json"]) == 0
    (batch,) = json.loads(capsys.readouterr().out)["data"]

    # Chat answers export as Parquet rows: the id is data there, kept as it was; stderr stays clean.
    out = tmp_path / "export" / "answers.parquet"
    out.parent.mkdir()
    assert main(["results", batch["id"], "--format", "parquet", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "wrote 1 answers to" in err
    _no_controls(err)
    assert pq.read_table(out).column("custom_id").to_pylist() == [HOSTILE]

    # The results lines on a terminal: the same JSON, nothing raw a terminal would act on.
    master, slave = pty.openpty()
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor.worker.entrypoints.cli", "results", batch["id"]],
        stdout=slave, stderr=subprocess.PIPE, timeout=120, check=False,
    )  # fmt: skip
    os.close(slave)
    shown = _read_all(master)
    assert proc.returncode == 0, proc.stderr
    (line,) = [json.loads(x) for x in shown.decode().splitlines() if x.strip()]
    assert line["custom_id"] == HOSTILE
    _no_controls(shown.decode())


def _read_all(fd: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the pty's other end closed
            break
        if not chunk:
            break
        data += chunk
    os.close(fd)
    return data
