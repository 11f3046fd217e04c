"""The ``conveyor`` command, run in-process through ``worker.cli.main``."""

from __future__ import annotations

import json
import re

import pytest

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.store.schema import head_revision
from tests.worker.helpers import REPO, jsonl, openai_lines

EXAMPLE = str(REPO / "examples" / "requests.jsonl")


def test_run_writes_results_and_errors_files(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    out, err = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    assert main(["run", EXAMPLE, "--model", stack.model, "-o", str(out), "--errors", str(err), "-q"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [json.loads(line) for line in err.read_text().splitlines()]
    assert len(results) == 6 and len(errors) == 2
    assert [e["error"]["line"] for e in errors] == [7, 8]
    summary = capsys.readouterr().err
    assert "completed" in summary and "6 completed, 2 failed of 8" in summary


def test_run_prints_results_to_stdout(embedded_stack, env, capsys) -> None:
    stack = env(embedded_stack)
    data = jsonl(openai_lines(3))
    path = embedded_stack.values["home"] + "-in.jsonl"
    with open(path, "wb") as f:
        f.write(data)
    assert main(["run", path, "--model", stack.model, "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == ["req-0", "req-1", "req-2"]


def test_submit_status_results_cancel(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(4)))
    assert main(["submit", str(path), "--model", stack.model, "--shard-size", "2", "--json"]) == 0
    job = json.loads(capsys.readouterr().out)
    assert job["status"] == "in_progress" and job["num_shards"] == 2  # no worker: it waits in the broker
    assert main(["status", job["id"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request_counts"]["total"] == 4
    assert main(["results", job["id"]]) == 1
    assert "is in_progress" in capsys.readouterr().err
    assert main(["cancel", job["id"]]) == 0
    assert "cancelled" in capsys.readouterr().out
    assert main(["results", job["id"], "--errors", "-o", str(tmp_path / "e.jsonl")]) == 0
    errors = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"req-{i}", "batch_cancelled") for i in range(4)]
    assert main(["submit", str(path), "--model", stack.model]) == 0
    assert re.fullmatch(r"batch_[0-9a-f]{32}\n", capsys.readouterr().out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "/no/such.jsonl", "--model", "{model}"], "input file '/no/such.jsonl' does not exist"),
        (["status", "nope"], "is not a job id"),
        (["status", "batch_" + "0" * 32], "no job batch_"),
        (["submit", "{example}", "--model", "/no/such/model/dir"], "is not a local directory nor a hub id"),
        (["submit", "{example}", "--model", "{model}", "--shard-size", "0"], "shard size must be an integer from 1"),
    ],
)
def test_user_errors_are_one_line_without_traceback(embedded_stack, env, capsys, argv, message) -> None:
    stack = env(embedded_stack)
    argv = [a.format(model=stack.model, example=EXAMPLE) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("conveyor: error:")


def test_bad_settings_name_the_variable(embedded_stack, env, capsys, monkeypatch) -> None:
    env(embedded_stack)
    monkeypatch.setenv("CONVEYOR_SHARD_SIZE", "lots")
    assert main(["status", "batch_" + "0" * 32]) == 1
    err = capsys.readouterr().err
    assert "invalid settings: CONVEYOR_SHARD_SIZE" in err and "Traceback" not in err


def test_db_upgrade_then_worker_refuses_an_outdated_schema(pg_admin_user, tmp_path, tiny_model, env, capsys) -> None:
    import uuid

    import psycopg

    from tests.worker.helpers import Stack, make_values
    from tests.worker.services import PG_DB, PG_HOST, PG_PORT

    schema = f"conveyor_cli_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(host=PG_HOST, port=PG_PORT, user=pg_admin_user, dbname=PG_DB, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    url = f"postgresql://{pg_admin_user}:hunter2@{PG_HOST}:{PG_PORT}/{PG_DB}?options=-csearch_path%3D{schema}"
    try:
        env(Stack(make_values(tmp_path, tiny_model, database_url=url), tiny_model))
        assert main(["worker", "--model", tiny_model]) == 1
        err = capsys.readouterr().err
        assert "run `conveyor db upgrade`" in err and "hunter2" not in err and "***" in err
        assert main(["db", "upgrade"]) == 0
        out = capsys.readouterr().out
        assert f"schema revision {head_revision()}\n" in out and "hunter2" not in out
    finally:
        with psycopg.connect(host=PG_HOST, port=PG_PORT, user=pg_admin_user, dbname=PG_DB, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_bench_measures_a_synthetic_workload(tiny_model, capsys) -> None:
    args = [
        "bench",
        "--model",
        tiny_model,
        "--requests",
        "6",
        "--prompt-tokens",
        "8-20",
        "--output-tokens",
        "3-5",
        "--shared-prefix",
        "32",
        "--json",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] == 6 and 18 <= result["output_tokens"] <= 30
    assert result["prompt_tokens"] >= 6 * (32 + 8) and result["cached_prompt_tokens"] >= 5 * 32
    assert result["output_tokens_per_s"] > 0 and result["ttft_p50"] > 0 and result["engine"]["device"] == "cpu"
    assert main(["bench", "--model", tiny_model, "--requests", "2", "--output-tokens", "2"]) == 0
    assert "output tok/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--output-tokens", "5-2"], "--output-tokens must satisfy"),
        (["--prompt-tokens", "x"], "--prompt-tokens must be N or LOW-HIGH"),
        (["--requests", "0"], "requests must be from 1"),
    ],
)
def test_bench_rejects_bad_ranges_with_one_line(tiny_model, capsys, bad, message) -> None:
    assert main(["bench", "--model", tiny_model, *bad]) == 1
    assert message in capsys.readouterr().err
