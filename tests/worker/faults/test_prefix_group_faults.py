"""Jobs grouped by shared prefix under faults: a worker killed mid-group, redelivered and
duplicated shard messages, a cancel and an expiry each keep every line exactly once, and the
files in input order."""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import func, select

from benchmarks.prefix_shapes import many_questions
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import run_shard
from conveyor.worker.execution.shard_turns import run_next_shard
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Item, Shard
from tests.worker.helpers import SLOW_ENGINE, jsonl, parse_lines, stored_items, wait_for


def _lines(docs: int, questions: int, *, max_tokens: int = 3, ignore_eos: bool = False) -> list[dict[str, Any]]:
    lines = many_questions(docs, questions, 300, shuffled=True, seed=11, max_tokens=max_tokens).lines
    for line in lines:
        line["body"]["ignore_eos"] = ignore_eos
    return lines


def _ids(lines: list[dict[str, Any]]) -> list[str]:
    return [line["custom_id"] for line in lines]


def _shard_lines(client: Client, job_id: str, index: int) -> tuple[int, ...]:
    with client.db.connect() as conn:
        return tuple(
            conn.execute(
                select(Item.line).where(Item.job_id == job_id, Item.shard_index == index).order_by(Item.line)
            ).scalars()
        )


def test_duplicated_shard_messages_run_each_line_once(embedded_stack) -> None:
    """Every shard message delivered twice (a redelivery after a lost ack, a duplicate), taken
    by four turns at once with affinity on: each line is stored once, the files in input order."""
    lines = _lines(6, 5)
    client = Client(embedded_stack.settings)
    job = client.submit(jsonl(lines), embedded_stack.model, shard_size=5, enqueue=False, shard_order="prefix")
    messages = [i for i in range(job["num_shards"]) for _ in range(2)]
    ctx = WorkerContext.create(embedded_stack.settings)
    lock = threading.Lock()

    def turns() -> None:
        while True:
            with lock:
                if not messages:
                    return
                index = messages.pop()
            run_next_shard(ctx, job["id"], index)

    threads = [threading.Thread(target=turns) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        ctx.close()
    job = client.wait(job["id"], timeout=30, poll=0.1)
    assert job["status"] == "completed" and job["request_counts"]["completed"] == len(lines)
    assert [r["custom_id"] for r in parse_lines(client.results(job["id"]))] == _ids(lines)
    with client.db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Item).where(Item.job_id == job["id"])).scalar() == len(
            lines
        )
    assert ctx.affinity.turns >= job["num_shards"]
    client.close()


def test_a_cancelled_grouped_job_keeps_its_finished_shard_in_input_order(embedded_stack) -> None:
    lines = _lines(4, 5)
    client = Client(embedded_stack.settings)
    job = client.submit(jsonl(lines), embedded_stack.model, shard_size=5, enqueue=False, shard_order="prefix")
    ctx = WorkerContext.create(embedded_stack.settings)
    try:
        assert run_shard(ctx, job["id"], 1).status == "completed"
    finally:
        ctx.close()
    done = _shard_lines(client, job["id"], 1)
    assert len(done) == 5
    cancelled = client.cancel(job["id"])
    assert cancelled["status"] == "cancelled" and cancelled["request_counts"]["completed"] == 5
    results = [r["custom_id"] for r in parse_lines(client.results(job["id"]))]
    assert results == [lines[n - 1]["custom_id"] for n in done]  # that shard's lines, by input line
    client.close()


def test_an_expired_grouped_job_reports_the_rest_by_line(embedded_stack) -> None:
    stack = embedded_stack.with_values(min_completion_window_seconds=1)
    lines = _lines(4, 5)
    client = Client(stack.settings)
    job = client.submit(
        jsonl(lines), stack.model, shard_size=5, completion_window="2s", enqueue=False, shard_order="prefix"
    )
    ctx = WorkerContext.create(stack.settings)
    try:
        assert run_shard(ctx, job["id"], 2).status == "completed"  # the other shards never run
    finally:
        ctx.close()
    done = set(_shard_lines(client, job["id"], 2))
    time.sleep(max(0.0, job["expires_at"] + 1 - time.time()))
    job = client.wait(job["id"], timeout=10, poll=0.1)
    assert job["status"] == "expired", job
    assert job["request_counts"] == {"total": 20, "completed": 5, "failed": 15}
    results = [r["custom_id"] for r in parse_lines(client.results(job["id"]))]
    errors = parse_lines(client.results(job["id"], errors=True))
    assert results == [line["custom_id"] for n, line in enumerate(lines, 1) if n in done]
    assert [e["custom_id"] for e in errors] == [line["custom_id"] for n, line in enumerate(lines, 1) if n not in done]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    client.close()


def test_a_worker_killed_mid_group_is_replaced_and_every_line_is_stored_once(embedded_stack, spawn_worker) -> None:
    stack = embedded_stack.with_values(engine_args=SLOW_ENGINE, shard_order="prefix")
    first = spawn_worker(stack, concurrency=2)
    first.wait_ready()
    client = Client(stack.settings)
    lines = _lines(8, 4, max_tokens=160, ignore_eos=True)
    job = client.submit(jsonl(lines), stack.model, shard_size=4)
    assert job["shard_order"] == "prefix"
    db = create_db_engine(stack.settings.database)
    wait_for(lambda: stored_items(db, job["id"]) >= 3, 60, "the first items")
    first.kill9()
    assert stored_items(db, job["id"]) < len(lines), "the job finished before the worker was killed"
    spawn_worker(stack, concurrency=2)
    job = client.wait(job["id"], timeout=120, poll=0.2)
    assert job["status"] == "completed", job
    assert job["request_counts"] == {"total": len(lines), "completed": len(lines), "failed": 0}
    assert [r["custom_id"] for r in parse_lines(client.results(job["id"]))] == _ids(lines)
    with db.connect() as conn:
        attempts = conn.execute(select(func.max(Shard.attempts)).where(Shard.job_id == job["id"])).scalar()
        keys = set(conn.execute(select(Shard.group_key).where(Shard.job_id == job["id"])).scalars())
    assert attempts is not None and attempts >= 2, "a shard the dead worker held should have been run again"
    assert None not in keys and len(keys) == 8  # one document's questions a shard
    db.dispose()
    client.close()
