"""Two fixed workers lose their broker mid-job to a SIGKILL, and it comes back empty (its
queues and messages gone): they take shards again within seconds, and every line is answered
exactly once. Nothing starts a fresh worker here (no autoscaler): the workers that saw the
broker go must consume again themselves, whatever they were running or had not acknowledged.

The broker is a private instance (the machine's own are never stopped); PostgreSQL is a fresh
schema and S3 is moto's server, as in the other service tests.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select

from conveyor.worker.broker.app import create_app
from conveyor.worker.broker.app_state import require_state
from conveyor.worker.broker.queues import queue_depth
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Shard
from conveyor.worker.store.schema import upgrade_database
from tests.worker.helpers import (
    Stack,
    assert_each_request_once,
    jsonl,
    make_values,
    openai_lines,
    scrape,
    stored_items,
    wait_for,
)
from tests.worker.private_services import PrivateRabbitMQ, PrivateRedis
from tests.worker.services import free_port

LINES = 400
SHARD_SIZE = 10  # 40 shards: two running on each worker at any moment
BOUND_SECONDS = 60.0  # from the broker's restart to the job's end
OUTAGE_SECONDS = 3.0


@pytest.fixture(params=["redis", "rabbitmq"])
def private_broker(request: pytest.FixtureRequest, tmp_path) -> Iterator[PrivateRedis | PrivateRabbitMQ]:
    kind = request.param
    binary = "redis-server" if kind == "redis" else PrivateRabbitMQ.SERVER
    if shutil.which(binary) is None:
        pytest.skip(f"SERVICE DOWN: {binary} is not here (this test restarts a private {kind})")
    broker = PrivateRedis(tmp_path / "redis") if kind == "redis" else PrivateRabbitMQ(tmp_path / "rabbitmq")
    yield broker
    broker.close()


def test_workers_consume_again_after_the_broker_restarts_empty(
    private_broker, pg_url, s3_bucket, aws_env, tiny_model, spawn_worker, tmp_path
) -> None:
    upgrade_database(pg_url)
    values = make_values(
        tmp_path / "home", tiny_model, database_url=pg_url, broker_url=private_broker.url,
        storage_url=f"s3://{s3_bucket}/conveyor",
        # A call the restarted broker never answers fails in 10 s, well inside BOUND_SECONDS.
        broker_read_timeout=10.0,
    )  # fmt: skip
    stack = Stack(values, tiny_model)  # the AWS variables come from aws_env
    ports = [free_port(), free_port()]
    workers = [spawn_worker(stack, concurrency=2, metrics_port=port) for port in ports]
    for worker in workers:
        worker.wait_ready()
    client = Client(stack.settings)
    db = create_db_engine(pg_url)
    job_id = client.submit(jsonl(openai_lines(LINES)), stack.model, shard_size=SHARD_SIZE)["id"]
    deadline = time.monotonic() + 60
    while stored_items(db, job_id) < LINES // 4:  # mid-job: shards running on both workers
        assert time.monotonic() < deadline, "the job did not get a quarter through in 60 s"
        time.sleep(0.1)

    private_broker.kill()
    killed_at = time.monotonic()
    at_kill = stored_items(db, job_id)
    # The demand comes from the database, so an autoscaler still sees the work while the broker
    # is down (read now: once the broker is back, the job may be done before the first scrape).
    waiting = wait_for(lambda: _demand(ports[0]), 10, "the demand metric during the outage")
    assert waiting > 0
    time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - killed_at)))
    private_broker.restart_empty()
    restarted_at = time.monotonic()

    try:
        job = client.wait(job_id, timeout=BOUND_SECONDS, poll=0.5)
    except TimeoutError as exc:
        pytest.fail(f"{exc}; {at_kill} were stored at the kill\n{_stuck_report(db, job_id, stack, workers)}")
    took = time.monotonic() - restarted_at
    assert took < BOUND_SECONDS
    for port in ports:  # each worker consumes again, as it says
        wait_for(functools.partial(_ready, port), 10, f"/readyz on {port}")
    assert_each_request_once(client, db, job, LINES)
    db.dispose()
    client.close()


def _stuck_report(db, job_id: str, stack: Stack, workers) -> str:
    """What a stall leaves to read in CI's log: where the shards stand, what the broker holds,
    and every thread's stack in each worker (Celery dumps them on SIGUSR1)."""
    with db.connect() as conn:
        shards = conn.execute(
            select(Shard.status, func.count()).where(Shard.job_id == job_id).group_by(Shard.status)
        ).all()
    try:
        app = create_app(stack.settings, stack.model)
        depth: int | str | None = queue_depth(app, require_state(app).queue)
    except Exception as exc:  # the report must not hide the failure it reports
        depth = f"unknown ({exc})"
    before = [len(worker.log()) for worker in workers]
    for worker in workers:
        os.kill(worker.pid, signal.SIGUSR1)
    time.sleep(2)
    parts = [f"shards: {dict((str(s), n) for s, n in shards)}; messages ready on the queue: {depth}"]
    for i, (worker, cut) in enumerate(zip(workers, before, strict=True)):
        text = worker.log()
        lines = [line for line in text[:cut].splitlines() if not line.startswith((" ", "Traceback"))]
        parts.append(f"--- worker {i}\n" + "\n".join(lines[-120:]) + "\n--- its threads\n" + _stacks(text[cut:]))
    return "\n".join(parts)


def _stacks(cry: str) -> str:
    """The thread names and frames of Celery's dump, without its local variables."""
    lines = cry.splitlines()
    kept = [
        line
        for n, line in enumerate(lines)
        if line.startswith('  File "')
        or (n + 1 < len(lines) and lines[n + 1].startswith("====") and line and not line.startswith(("=", "LOCAL")))
    ]
    return "\n".join(kept)


def _demand(port: int) -> float:
    return sum(sample.value for sample in scrape(port, timeout=3).find("conveyor_demand"))


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=3) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:  # 503: not ready
        return False
