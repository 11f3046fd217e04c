"""The job lifecycle in one process (no broker): validation and error records, request
counts, finalisation over many shards, cancel of a queued job, results and follow."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.engine import Engine

from conveyor.worker.broker.queues import BrokerUnavailable
from conveyor.worker.entrypoints.client import Client, JobNotFinished
from conveyor.worker.entrypoints.local_runner import run_job
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import run_shard
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.lifecycle import JobNotFound
from conveyor.worker.jobs.object_keys import InvalidJobId
from conveyor.worker.store.models import Job, Shard, ShardStatus
from tests.worker.helpers import jsonl, openai_lines, parse_lines


def _lines(client: Client, job_id: str, errors: bool = False, *, follow: bool = False) -> Iterator[str]:
    """``client.results`` without ``to``: the lines themselves, not a count."""
    lines = client.results(job_id, errors, follow=follow)
    assert not isinstance(lines, int)
    return lines


def _errors(client: Client, job_id: str) -> list[tuple]:
    """(custom_id, line, code) per errors-file line: a line rejected at validation has
    ``error`` (with its line); a request that ran and failed has only its HTTP ``response``."""
    out = []
    for e in parse_lines(client.results(job_id, errors=True)):
        if e["error"] is not None:
            assert e["response"] is None
            out.append((e["custom_id"], e["error"]["line"], e["error"]["code"]))
        else:
            out.append((e["custom_id"], None, e["response"]["body"]["error"]["code"]))
    return out


def test_malformed_lines_become_error_records_and_the_job_completes(embedded_stack) -> None:
    stack = embedded_stack.with_values(engine_args={"num_kv_blocks": 256, "max_model_len": 48})
    good = openai_lines(6, url="/v1/completions")
    rows = [
        good[0],
        b"{not json",
        good[1],
        {"custom_id": "x1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "", "max_tokens": 4}},
        good[2],
        {"custom_id": "req-0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "dup"}},
        {"custom_id": "x2", "method": "POST", "url": "/v1/moderations", "body": {"input": "hi"}},
        good[3],
        {
            "custom_id": "long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "soup " * 80, "max_tokens": 4},
        },
        {"custom_id": "x3", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "temperature": 9}},
        b"",
        {"prompt": "a plain row", "max_tokens": 4, "temperature": 0},
        {"custom_id": "nul\u0000id", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}},
        good[4],
        good[5],
    ]
    job = run_job(stack.settings, jsonl(rows), stack.model, shard_size=3)
    client = Client(stack.settings)
    assert job["status"] == "completed", job
    # 14 non-blank lines: 6 rejected at validation, 1 rejected by the engine (prompt too long)
    assert job["request_counts"] == {"total": 14, "completed": 7, "failed": 7}
    assert _errors(client, job["id"]) == [
        ("line-2", 2, "invalid_json"),
        ("x1", 4, "invalid_value"),
        ("req-0", 6, "duplicate_custom_id"),
        ("x2", 7, "invalid_value"),
        ("long", None, "prompt_too_long"),  # ran: after line 7's error and before line 10's
        ("x3", 10, "invalid_value"),
        ("nul\u0000id", 13, "invalid_value"),
    ]
    long_error = next(e for e in parse_lines(client.results(job["id"], errors=True)) if e["custom_id"] == "long")
    assert long_error["response"]["status_code"] == 400 and long_error["error"] is None
    assert "prompt is" in long_error["response"]["body"]["error"]["message"]
    results = parse_lines(client.results(job["id"]))
    assert [r["custom_id"] for r in results] == ["req-0", "req-1", "req-2", "req-3", "line-12", "req-4", "req-5"]
    client.close()


def test_an_input_rejected_as_a_whole_fails_the_job(embedded_stack) -> None:
    stack = embedded_stack.with_values(max_lines_per_job=3)
    client = Client(stack.settings)
    job = client.submit(jsonl(openai_lines(5)), stack.model, enqueue=False)
    assert job["status"] == "failed" and job["failed_at"]
    assert "more than 3 lines" in job["errors"]["data"][0]["message"]
    header_only = client.submit(b"text,other\na,b\n", stack.model, input_format="csv", enqueue=False)
    assert header_only["status"] == "failed" and "prompt" in header_only["errors"]["data"][0]["message"]
    client.close()


def test_bad_options_are_refused_naming_the_value(embedded_stack) -> None:
    client = Client(embedded_stack.settings)
    with pytest.raises(ValueError, match="shard size"):
        client.submit(b"{}", embedded_stack.model, shard_size=0, enqueue=False)
    with pytest.raises(ValueError, match="priority"):
        client.submit(b"{}", embedded_stack.model, priority=10**6, enqueue=False)
    with pytest.raises(ValueError, match="not a local directory nor a hub id"):
        client.submit(b"{}", "./no/such/dir", enqueue=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        client.submit("/no/such/input.jsonl", embedded_stack.model, enqueue=False)
    with pytest.raises(InvalidJobId):
        client.status("../../etc")
    with pytest.raises(JobNotFound):
        client.status("batch_" + "0" * 32)
    client.close()


def test_all_lines_invalid_completes_at_submit(embedded_stack) -> None:
    client = Client(embedded_stack.settings)
    job = client.submit(b"nope\n[1]\n", embedded_stack.model, enqueue=False)
    assert job["status"] == "completed" and job["num_shards"] == 0
    assert job["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert list(_lines(client, job["id"])) == [] and len(list(_lines(client, job["id"], errors=True))) == 2
    client.close()


def _job_wide_item_reads(statements: list[str]) -> int:
    """Statements that read a job's items without narrowing them to one shard."""
    return sum(1 for sql in statements if "FROM items" in sql and "items.shard_index =" not in sql)


def test_many_shards_finalise_in_input_order_on_postgres_and_s3(pg_url, s3_bucket, tiny_model, tmp_path) -> None:
    from conveyor.worker.store.schema import upgrade_database
    from tests.worker.helpers import Stack, make_values

    upgrade_database(pg_url)
    stack = Stack(make_values(tmp_path, tiny_model, database_url=pg_url, storage_url=f"s3://{s3_bucket}/x"), tiny_model)
    n = 60
    rows: list = []
    for i, line in enumerate(openai_lines(n, max_tokens=4)):
        rows.append(line)
        if i % 7 == 3:
            rows.append(b"garbage")
    statements: list[str] = []

    def capture(_conn, _cursor, statement, _parameters, _context, _many) -> None:
        statements.append(statement)

    event.listen(Engine, "before_cursor_execute", capture)
    try:
        job = run_job(stack.settings, jsonl(rows), stack.model, shard_size=1, concurrency=4)
    finally:
        event.remove(Engine, "before_cursor_execute", capture)
    assert job["status"] == "completed" and job["num_shards"] == n
    # What grows with the job stays per shard: the job-wide reads of its items are the
    # finaliser's few (counts, usage, percentiles, the results), not one or more per shard.
    assert 0 < _job_wide_item_reads(statements) < 20
    bad = len(rows) - n
    assert job["request_counts"] == {"total": len(rows), "completed": n, "failed": bad}
    client = Client(stack.settings)
    results = parse_lines(client.results(job["id"]))
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(n)]
    errors = parse_lines(client.results(job["id"], errors=True))
    lines = [e["error"]["line"] for e in errors]
    assert len(errors) == bad and lines == sorted(lines)
    # The job ended: its input copy, shards, parts and rejected lines went; its two files stay.
    store = client.store.scoped(object_keys.job_prefix(job["id"]))
    assert list(store.list()) == [object_keys.ERRORS, object_keys.RESULTS]
    client.close()


def test_cancel_a_queued_job_with_no_worker(embedded_stack) -> None:
    client = Client(embedded_stack.settings)
    job = client.submit(jsonl(openai_lines(10)), embedded_stack.model, shard_size=2, enqueue=False)
    ctx = WorkerContext.create(embedded_stack.settings)
    assert run_shard(ctx, job["id"], 0).status == "completed"
    cancelled = client.cancel(job["id"])
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"]
    assert cancelled["request_counts"] == {"total": 10, "completed": 2, "failed": 8}  # 8 batch_cancelled
    assert [r["custom_id"] for r in parse_lines(client.results(job["id"]))] == ["req-0", "req-1"]
    # A late shard message finds the job cancelled and does nothing.
    assert run_shard(ctx, job["id"], 1).status == "skipped"
    assert client.cancel(job["id"])["status"] == "cancelled"  # idempotent
    with client.db.connect() as conn:
        statuses = (
            conn.execute(select(Shard.status).where(Shard.job_id == job["id"]).order_by(Shard.shard_index))
            .scalars()
            .all()
        )
    assert statuses[0] is ShardStatus.completed and set(statuses[1:]) == {ShardStatus.cancelled}
    ctx.close()
    client.close()


def test_results_of_a_running_job_need_follow_which_streams_shard_by_shard(embedded_stack) -> None:
    client = Client(embedded_stack.settings)
    job = client.submit(jsonl([*openai_lines(6), b"bad"]), embedded_stack.model, shard_size=2, enqueue=False)
    with pytest.raises(JobNotFinished, match="in_progress"):
        client.results(job["id"])
    followed: list[str] = []
    errors: list[str] = []
    reader = threading.Thread(target=lambda: followed.extend(_lines(client, job["id"], follow=True)))
    reader.start()
    ctx = WorkerContext.create(embedded_stack.settings)
    for index in range(3):
        run_shard(ctx, job["id"], index)
    reader.join(30)
    assert not reader.is_alive()
    errors = list(_lines(client, job["id"], errors=True, follow=True))
    assert client.status(job["id"])["status"] == "completed"
    assert followed == list(_lines(client, job["id"]))
    assert [json.loads(e)["error"]["line"] for e in errors] == [7]
    ctx.close()
    client.close()


def test_an_unreachable_broker_is_named_before_a_job_is_created(embedded_stack) -> None:
    # (A broker lost between this check and the enqueue fails the job with enqueue_failed,
    # which conveyor retry takes up: tests/worker/faults/test_broker_down.py.)
    stack = embedded_stack.with_values(broker_url="redis://127.0.0.1:1/0", broker_transport_options={"max_retries": 0})
    client = Client(stack.settings)
    with pytest.raises(BrokerUnavailable, match=re.escape("cannot reach the broker at redis://127.0.0.1:1/0")):
        client.submit(jsonl(openai_lines(2)), stack.model)
    with client.db.connect() as conn:  # nothing was created: not even the database was touched
        assert conn.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    client.close()
