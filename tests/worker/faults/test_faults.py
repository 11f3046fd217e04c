"""Faults and concurrency with real worker subprocesses: two workers sharing a queue, a
worker killed with SIGKILL mid-job and another taking over, and cancelling a running job."""

from __future__ import annotations

import time
from collections import Counter

from sqlalchemy import func, select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Item, ItemStatus, Job, Shard
from tests.worker.helpers import SLOW_ENGINE, jsonl, openai_lines, parse_lines, stored_items, wait_for

# Slow enough to be caught mid-flight: one sequence at a time, long generations (ignore_eos).


def test_two_workers_share_one_queue(pg_redis_s3_stack, spawn_worker) -> None:
    stack = pg_redis_s3_stack.with_values(engine_args={"num_kv_blocks": 512, "max_num_seqs": 2})
    workers = [spawn_worker(stack, concurrency=1), spawn_worker(stack, concurrency=1)]
    for w in workers:
        w.wait_ready()
    client = Client(stack.settings)
    n = 16
    job = client.submit(jsonl(openai_lines(n, max_tokens=24, ignore_eos=True)), stack.model, shard_size=2)
    job = client.wait(job["id"], timeout=90, poll=0.2)
    errors = parse_lines(client.results(job["id"], errors=True))
    assert job["status"] == "completed" and job["request_counts"]["completed"] == n, errors[:3]
    ids = [r["custom_id"] for r in parse_lines(client.results(job["id"]))]
    assert ids == [f"req-{i}" for i in range(n)]
    db = create_db_engine(stack.settings.database)
    with db.connect() as conn:
        by_worker = Counter(conn.execute(select(Item.worker_id).where(Item.job_id == job["id"])).scalars())
    assert len(by_worker) == 2, f"both workers should have run shards: {by_worker}"
    db.dispose()
    client.close()


def test_sigkilled_worker_is_replaced_and_every_item_is_stored_once(embedded_stack, spawn_worker) -> None:
    """Embedded broker (kombu's SQLAlchemy transport drops a dead consumer's messages): the
    new worker's sweeper takes over the expired leases and re-enqueues the lost shards."""
    stack = embedded_stack.with_values(engine_args=SLOW_ENGINE)
    first = spawn_worker(stack, concurrency=2)
    first.wait_ready()
    client = Client(stack.settings)
    n = 32
    job = client.submit(jsonl(openai_lines(n, max_tokens=160, ignore_eos=True)), stack.model, shard_size=4)
    db = create_db_engine(stack.settings.database)
    wait_for(lambda: stored_items(db, job["id"]) >= 3, 60, "the first items")
    first.kill9()
    killed_at = stored_items(db, job["id"])
    assert killed_at < n, "the job finished before the worker was killed; make it slower"

    second = spawn_worker(stack, concurrency=2)
    job = client.wait(job["id"], timeout=120, poll=0.2)
    assert job["status"] == "completed", job
    assert job["request_counts"] == {"total": n, "completed": n, "failed": 0}
    ids = [r["custom_id"] for r in parse_lines(client.results(job["id"]))]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(n)) and len(ids) == n  # exactly once
    assert ids == [f"req-{i}" for i in range(n)]  # in input order
    with db.connect() as conn:
        workers = set(conn.execute(select(Item.worker_id).where(Item.job_id == job["id"])).scalars())
        attempts = conn.execute(select(func.max(Shard.attempts)).where(Shard.job_id == job["id"])).scalar()
    assert len(workers) == 2, workers  # both did part of it
    assert attempts is not None and attempts >= 2, "a shard the dead worker held should have been run again"
    assert "expired leases" in second.log() or "lost messages" in second.log()
    db.dispose()
    client.close()


def test_cancel_withdraws_waiting_items_and_keeps_the_running_ones(pg_redis_s3_stack, spawn_worker) -> None:
    stack = pg_redis_s3_stack.with_values(engine_args=SLOW_ENGINE)
    worker = spawn_worker(stack, concurrency=2)
    worker.wait_ready()
    client = Client(stack.settings)
    n = 40
    job = client.submit(jsonl(openai_lines(n, max_tokens=240, ignore_eos=True)), stack.model, shard_size=4)
    db = create_db_engine(stack.settings.database)
    wait_for(lambda: stored_items(db, job["id"]) >= 2, 60, "the first items")
    t0 = time.monotonic()
    cancelled = client.cancel(job["id"])
    assert cancelled["status"] in ("cancelling", "cancelled")
    job = client.wait(job["id"], timeout=20, poll=0.1)
    took = time.monotonic() - t0
    assert job["status"] == "cancelled", job
    assert took < 10, f"cancel took {took:.1f} s"
    counts = job["request_counts"]
    done = counts["completed"]
    assert 2 <= done < n
    assert counts["total"] == n and counts["failed"] == n - done  # the rest: batch_cancelled
    assert stored_items(db, job["id"]) == n
    results = parse_lines(client.results(job["id"]))
    assert len(results) == counts["completed"] and all(r["response"]["status_code"] == 200 for r in results)
    time.sleep(1.0)
    assert stored_items(db, job["id"]) == n, "items kept finishing after the cancel"
    with db.connect() as conn:
        assert conn.execute(select(Job.cancelled_at).where(Job.id == job["id"])).scalar() is not None
        statuses = Counter(conn.execute(select(Item.status).where(Item.job_id == job["id"])).scalars())
    assert statuses == {ItemStatus.succeeded: done, ItemStatus.failed: n - done}
    assert "withdrawing" in worker.log()
    db.dispose()
    client.close()


def test_lost_broker_messages_are_enqueued_again(pg_redis_s3_stack, spawn_worker) -> None:
    """The broker lost a job's messages (purged here before any worker saw them; a Redis
    without persistence that restarted, say): a worker's sweeper finds the queue empty and
    the shards still pending a whole lease period after they were enqueued, and enqueues
    them again. Nothing is lost and nothing is done twice."""
    from conveyor.worker.broker.app import create_app
    from conveyor.worker.broker.queues import model_queue, queue_depth

    stack = pg_redis_s3_stack
    client = Client(stack.settings)
    n = 8
    job = client.submit(jsonl(openai_lines(n)), stack.model, shard_size=4)
    app = create_app(stack.settings, stack.model)
    queue = app.conf.task_default_queue
    assert queue_depth(app, queue) == 2  # one message per shard
    with app.connection_for_write() as conn:
        assert model_queue(queue)(conn.default_channel).purge() == 2
    assert queue_depth(app, queue) == 0

    worker = spawn_worker(stack)
    job = client.wait(job["id"], timeout=90, poll=0.2)
    assert job["status"] == "completed" and job["request_counts"] == {"total": n, "completed": n, "failed": 0}
    ids = [r["custom_id"] for r in parse_lines(client.results(job["id"]))]
    assert ids == [f"req-{i}" for i in range(n)]
    assert "2 with lost messages" in worker.log()
    db = create_db_engine(stack.settings.database)
    with db.connect() as conn:
        attempts = conn.execute(select(Shard.attempts).where(Shard.job_id == job["id"])).scalars().all()
    assert attempts == [1, 1]  # each shard ran once, from its re-enqueued message
    db.dispose()
    client.close()
