"""A ten-second PostgreSQL outage in the middle of a job, through a proxy the test cuts
between the worker and the shared server (which keeps running for everyone else).

A database error must never make a task acknowledge its message unprocessed: tasks wait for
the database and then run, or (waiting longer than ``dependency_retry_seconds``) hand their
message back to the broker to get it again. The sweeper is all but off here (one sweep at start, the next an
hour later), so the job completes only if no message was dropped, and promptly after the
database is back rather than a sweep later.
"""

from __future__ import annotations

import time

from sqlalchemy import func, select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Shard
from tests.worker.helpers import (
    SLOW_ENGINE,
    assert_each_request_once,
    jsonl,
    openai_lines,
    parse_lines,
    stored_items,
    wait_for,
)
from tests.worker.services import PG_HOST, PG_PORT

OUTAGE_SECONDS = 10.0


def _through_proxy(stack, proxy) -> str:
    url = stack.values["database_url"].replace(f"@{PG_HOST}:{PG_PORT}/", f"@{proxy.url_host()}/")
    assert url != stack.values["database_url"]
    return url


def test_a_database_outage_drops_no_message_and_needs_no_sweeper(pg_redis_s3_stack, spawn_worker, tcp_proxy) -> None:
    proxy = tcp_proxy(PG_HOST, PG_PORT)
    stack = pg_redis_s3_stack.with_values(
        engine_args=SLOW_ENGINE, sweep_interval_seconds=3600.0, dependency_backoff_max_seconds=1.0
    )
    worker = spawn_worker(stack, concurrency=2, database_url=_through_proxy(stack, proxy))
    worker.wait_ready()
    client = Client(stack.settings)
    db = create_db_engine(stack.settings.database)
    n = 24
    job = client.submit(jsonl(openai_lines(n, max_tokens=48, ignore_eos=True)), stack.model, shard_size=2)
    job_id = job["id"]
    wait_for(lambda: stored_items(db, job_id) >= 2, 60, "the first items")

    with proxy.outage():
        assert stored_items(db, job_id) < n - 4, "the job was nearly done before the outage; make it slower"
        time.sleep(OUTAGE_SECONDS)
    restored_at = time.monotonic()

    job = client.wait(job_id, timeout=60, poll=0.2)
    took = time.monotonic() - restored_at
    assert_each_request_once(client, db, job, n)
    with db.connect() as conn:
        failures = conn.execute(select(func.sum(Shard.failures)).where(Shard.job_id == job_id)).scalar_one()
    assert failures == 0
    log = worker.log()
    assert "raised unexpected" not in log, "a task gave its message up to a database error"
    assert log.count("database unreachable") == 1 and log.count("database back") == 1, log[-3000:]
    assert took < 30, f"the job took {took:.0f} s to finish after the database came back"
    db.dispose()
    client.close()


def test_messages_that_arrive_during_a_database_outage_go_back_to_the_broker(
    pg_redis_s3_stack, spawn_worker, tcp_proxy
) -> None:
    """An idle worker gets a job's messages while the database is down: each task waits
    ``dependency_retry_seconds`` (shortened here), then rejects its message back onto the
    queue, gets it again, and runs it once the database is back."""
    proxy = tcp_proxy(PG_HOST, PG_PORT)
    stack = pg_redis_s3_stack.with_values(
        sweep_interval_seconds=3600.0, dependency_backoff_max_seconds=1.0, dependency_retry_seconds=2.0
    )
    worker = spawn_worker(stack, concurrency=2, database_url=_through_proxy(stack, proxy))
    worker.wait_ready()
    client = Client(stack.settings)
    n = 8
    with proxy.outage():
        job = client.submit(jsonl(openai_lines(n)), stack.model, shard_size=4)
        wait_for(lambda: worker.log().count("handing the message back to the broker") >= 2, 30, "messages handed back")
        time.sleep(2.0)
    restored_at = time.monotonic()
    job = client.wait(job["id"], timeout=60, poll=0.2)
    took = time.monotonic() - restored_at
    assert job["status"] == "completed" and job["request_counts"] == {"total": n, "completed": n, "failed": 0}
    ids = [r["custom_id"] for r in parse_lines(client.results(job["id"]))]
    assert ids == [f"req-{i}" for i in range(n)]
    log = worker.log()
    assert "raised unexpected" not in log, "a task gave its message up to a database error"
    assert took < 30, f"the job took {took:.0f} s to finish after the database came back"
    client.close()
