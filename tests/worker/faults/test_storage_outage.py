"""A long object-storage outage in the middle of a job, through a proxy the test cuts between
the worker and the S3 server. An outage is no item's fault: the worker pauses new shards
(saying so once), keeps what its running shards finish, and goes on when storage is back.
Every item completes exactly once; none fails; no attempt is spent on the outage.

The outage lasts 45 s, longer than a failing shard's waits between four attempts (2 + 10 + 30 s,
``conveyor.worker.broker.tasks.RETRY_BACKOFF``; three are allowed) and fifteen leases of the test
settings: a worker that counted the outage as attempts, or let a lease lapse, would have failed
or lost every shard by then. ``CONVEYOR_TEST_STORAGE_OUTAGE_SECONDS`` sets another length
(``bench_faults.py`` runs outages of up to 60 s under a soak; three minutes passed too).
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit

from sqlalchemy import func, select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Shard
from tests.worker.helpers import SLOW_ENGINE, assert_each_request_once, jsonl, openai_lines, stored_items, wait_for

OUTAGE_SECONDS = float(os.environ.get("CONVEYOR_TEST_STORAGE_OUTAGE_SECONDS", "45"))


def test_a_long_storage_outage_is_waited_out_and_fails_no_item(
    pg_redis_s3_stack, spawn_worker, tcp_proxy, s3_endpoint
) -> None:
    s3 = urlsplit(s3_endpoint)
    proxy = tcp_proxy(s3.hostname, s3.port)
    stack = pg_redis_s3_stack.with_values(engine_args=SLOW_ENGINE, dependency_backoff_max_seconds=2.0)
    stack.extra_env["AWS_ENDPOINT_URL"] = f"http://{proxy.url_host()}"  # the worker's S3; the test's is direct
    worker = spawn_worker(stack, concurrency=2)
    worker.wait_ready()
    client = Client(stack.settings)
    db = create_db_engine(stack.settings.database)
    n = 24
    job = client.submit(jsonl(openai_lines(n, max_tokens=48, ignore_eos=True)), stack.model, shard_size=2)
    job_id = job["id"]
    wait_for(lambda: stored_items(db, job_id) >= 2, 60, "the first items")

    with proxy.outage():
        cut_at = time.monotonic()
        assert stored_items(db, job_id) < n - 4, "the job was nearly done before the outage; make it slower"
        time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - cut_at)))
        assert client.status(job_id)["status"] == "in_progress"
    restored_at = time.monotonic()

    job = client.wait(job_id, timeout=120, poll=0.2)
    assert_each_request_once(client, db, job, n)
    with db.connect() as conn:
        failures = conn.execute(select(func.sum(Shard.failures)).where(Shard.job_id == job_id)).scalar_one()
    assert failures == 0, "the outage was counted as failed attempts"
    log = worker.log()
    assert log.count("storage unreachable") == 1 and log.count("storage back") == 1, log[-3000:]
    assert "pausing new shards" in log
    print(f"recovered {time.monotonic() - restored_at:.1f} s after a {OUTAGE_SECONDS:.0f} s outage")
    db.dispose()
    client.close()
