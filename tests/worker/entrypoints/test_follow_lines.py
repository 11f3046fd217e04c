"""``conveyor results --follow`` writes each line as its item is stored, not shard by shard: a
one-shard job's file grows while it runs, in input order (the default) or completion order,
and ends as the results file does. The same job's chat results exported as Parquet read back
as its JSONL answers, field by field."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.schema import upgrade_database
from tests.worker.helpers import ENGINE, PYTHON, REPO, Stack, jsonl, make_values, openai_lines

ITEMS = 24
MAX_TOKENS = 256  # ignoring EOS, each line takes a fraction of a second: the job lasts seconds
BAD_LINE = 6  # a line rejected at validation, between answered ones


def _follow(stack: Stack, job_id: str, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PYTHON, "-m", "conveyor.worker.entrypoints.cli", "results", job_id, "--follow", "-o", str(out), *args],
        cwd=REPO, env=stack.env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True) if path.exists() else []


def test_follow_grows_while_a_one_shard_job_runs_and_ends_as_the_results_file(
    pg_url, tiny_model, env, spawn_worker, tmp_path, capsys
) -> None:
    upgrade_database(pg_url)
    # One request at a time, prepared by one input thread: the lines finish one by one, in
    # input order (with two threads a late first line would hold the input-order file back).
    slow = {**ENGINE, "max_num_seqs": 1}
    values = make_values(tmp_path / "home", tiny_model, database_url=pg_url, engine_args=slow, input_threads=1)
    stack = env(Stack(values, tiny_model))
    rows: list[Any] = list(openai_lines(ITEMS, max_tokens=MAX_TOKENS, ignore_eos=True))
    rows.insert(BAD_LINE - 1, b"{not json")
    path = tmp_path / "chat.jsonl"
    path.write_bytes(jsonl(rows))
    assert main(["submit", str(path), "--model", stack.model, "--json", "--shard-size", "64"]) == 0
    job = json.loads(capsys.readouterr().out)
    job_id = job["id"]
    assert job["num_shards"] == 1
    in_input, in_completion, errors = tmp_path / "input.jsonl", tmp_path / "completion.jsonl", tmp_path / "err.jsonl"
    followers = [
        _follow(stack, job_id, in_input),
        _follow(stack, job_id, in_completion, "--order", "completion"),
        _follow(stack, job_id, errors, "--errors"),
    ]
    client = Client(stack.settings)
    try:
        for proc in followers:  # each follower reports once it polls: only then may the job run
            assert proc.stderr is not None and "lines written" in proc.stderr.readline()
        worker = spawn_worker(stack, concurrency=1, engine_args=slow)
        partial: dict[Path, int] = {}
        deadline = time.monotonic() + 240
        while len(partial) < 2 and client.status(job_id)["status"] != "completed":
            assert time.monotonic() < deadline, worker.log()[-3000:]
            for out in (in_input, in_completion):
                written = len(_lines(out))
                # (read before the status: a job still in progress then was in progress at the read)
                if 0 < written < ITEMS and client.status(job_id)["status"] == "in_progress":
                    partial.setdefault(out, written)
            time.sleep(0.02)
        for proc in followers:
            assert proc.wait(timeout=240) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        client.close()
        for proc in followers:
            if proc.poll() is None:
                proc.kill()
    assert set(partial) == {in_input, in_completion}, f"seen some lines but not all while the job ran: {partial}"

    assert main(["results", job_id, "-o", str(tmp_path / "plain.jsonl")]) == 0
    plain = _lines(tmp_path / "plain.jsonl")
    assert len(plain) == ITEMS
    assert _lines(in_input) == plain  # the same bytes, in the same order
    completion = _lines(in_completion)
    assert sorted(completion) == sorted(plain)  # every line once, in whatever order they finished
    ids = [json.loads(line)["custom_id"] for line in completion]
    assert len(set(ids)) == len(ids) == ITEMS
    assert main(["results", job_id, "--errors", "-o", str(tmp_path / "plain-errors.jsonl")]) == 0
    assert _lines(errors) == _lines(tmp_path / "plain-errors.jsonl")
    (rejected,) = [json.loads(line) for line in _lines(errors)]
    assert rejected["error"]["line"] == BAD_LINE

    # Parquet of the chat results: one row per answer, the JSONL's fields.
    assert main(["results", job_id, "--format", "parquet", "-o", str(tmp_path / "chat.parquet")]) == 0
    table = pq.read_table(tmp_path / "chat.parquet").to_pylist()
    assert len(table) == ITEMS
    for row, line in zip(table, (json.loads(x) for x in plain), strict=True):
        body = line["response"]["body"]
        choice = body["choices"][0]
        assert row["custom_id"] == line["custom_id"] and row["status"] == "succeeded" and row["choice"] == 0
        assert row["text"] == choice["message"]["content"] and row["finish_reason"] == choice["finish_reason"]
        assert row["reasoning"] is None and row["tool_calls"] is None
        assert row["prompt_tokens"] == body["usage"]["prompt_tokens"] > 0
        assert row["completion_tokens"] == body["usage"]["completion_tokens"] == MAX_TOKENS
        assert row["error_code"] is None and row["error_message"] is None
    assert main(["results", job_id, "--errors", "--format", "parquet", "-o", str(tmp_path / "errors.parquet")]) == 0
    (failed,) = pq.read_table(tmp_path / "errors.parquet").to_pylist()
    assert failed["status"] == "failed" and failed["custom_id"] == rejected["custom_id"]
    assert (failed["error_code"], failed["error_message"]) == (rejected["error"]["code"], rejected["error"]["message"])
    assert failed["text"] is None
