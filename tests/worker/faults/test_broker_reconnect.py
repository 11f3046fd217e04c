"""A worker that loses its Redis connection while the broker loses its messages (a Redis that
restarted without persistence) gets the job going again as soon as it reconnects, not a
lease period and a sweep interval later.

The shared Redis keeps running: the worker reaches it through a proxy the test cuts, and
the loss of the messages is a purge of the job's queue during the cut.
"""

from __future__ import annotations

import time

from sqlalchemy import select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Shard
from tests.worker.helpers import jsonl, openai_lines, parse_lines, wait_for

# The sweeper's own schedule would find the lost messages only after a lease period and at
# its next run: both far beyond the bound this test allows.
SLOW_SWEEPS = {"lease_seconds": 60.0, "heartbeat_seconds": 10.0, "sweep_interval_seconds": 120.0}
BOUND_SECONDS = 30.0


def test_messages_lost_with_the_broker_are_enqueued_again_right_after_reconnecting(
    pg_redis_s3_stack, spawn_worker, tcp_proxy
) -> None:
    from conveyor.worker.broker.app import create_app
    from conveyor.worker.broker.queues import model_queue, queue_depth

    stack = pg_redis_s3_stack.with_values(**SLOW_SWEEPS)
    redis_url = stack.values["broker_url"]
    host_port = redis_url.removeprefix("redis://").split("/")[0]
    host, port = host_port.split(":")
    proxy = tcp_proxy(host, int(port))
    worker = spawn_worker(stack, broker_url=redis_url.replace(host_port, proxy.url_host()))
    worker.wait_ready()
    wait_for(lambda: "Connected to redis" in worker.log(), 30, "the worker's consumer to connect")

    client = Client(stack.settings)
    app = create_app(stack.settings, stack.model)
    queue = app.conf.task_default_queue
    n = 8
    with proxy.outage():
        wait_for(lambda: "Connection to broker lost" in worker.log(), 30, "the worker to lose its broker")
        job = client.submit(jsonl(openai_lines(n)), stack.model, shard_size=4)
        with app.connection_for_write() as conn:
            assert model_queue(queue)(conn.default_channel).purge() == 2  # the broker lost them
        assert queue_depth(app, queue) == 0
        time.sleep(2.0)
    restored_at = time.monotonic()

    job = client.wait(job["id"], timeout=BOUND_SECONDS + 30, poll=0.2)
    took = time.monotonic() - restored_at
    assert job["status"] == "completed" and job["request_counts"] == {"total": n, "completed": n, "failed": 0}
    ids = [r["custom_id"] for r in parse_lines(client.results(job["id"]))]
    assert ids == [f"req-{i}" for i in range(n)]
    log = worker.log()
    assert "broker connection back" in log and "2 with lost messages" in log, log[-3000:]
    assert took < BOUND_SECONDS, f"the job finished {took:.0f} s after the broker came back"
    db = create_db_engine(stack.settings.database)
    with db.connect() as conn:
        attempts = conn.execute(select(Shard.attempts).where(Shard.job_id == job["id"])).scalars().all()
    assert attempts == [1, 1]  # each shard ran once, from its re-enqueued message
    db.dispose()
    client.close()
