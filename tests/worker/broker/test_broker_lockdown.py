"""The broker takes jobs and nothing else (issue 22): an outside publisher with a plain Celery
client and nothing but broker access cannot ping, inspect, stop or stall a worker, run
Celery's built-in tasks, or park delayed messages in a worker's memory. A real worker on
Redis and on RabbitMQ, with PostgreSQL and S3 (moto)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from conveyor.worker.broker.queues import RUN_SHARD, SUBMIT_JOB, model_queue, queue_name, submit_queue_name
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.jobs.model_names import canonical_model
from tests.worker.broker_messages import load_example, producer, reply_queue, upload
from tests.worker.helpers import openai_lines, wait_for


@pytest.fixture(params=["pg_redis_s3_stack", "pg_amqp_s3_stack"])
def stack(request: pytest.FixtureRequest):
    return request.getfixturevalue(request.param)


@pytest.fixture
def outsider(stack) -> Iterator[Celery]:
    """A Celery client that knows the broker and nothing of Conveyor."""
    app = Celery("outsider", broker=stack.values["broker_url"], set_as_current=False)
    app.conf.broker_transport_options = stack.values.get("broker_transport_options") or {}
    yield app
    app.close()


def test_an_outside_publisher_cannot_steer_the_fleet(stack, outsider, spawn_worker) -> None:
    prefix = stack.values["queue_prefix"]
    model_q = model_queue(queue_name(canonical_model(stack.model), prefix))
    client = Client(stack.settings)
    uri = upload(client, openai_lines(2))
    worker = spawn_worker(stack)
    worker.wait_ready()

    # Remote control is off: no answer to ping or inspect; shutdown and cancel_consumer change nothing.
    assert outsider.control.ping(timeout=2.0) == []
    assert outsider.control.inspect(timeout=1.0).active_queues() is None
    outsider.control.cancel_consumer(model_q.name)
    outsider.control.cancel_consumer(submit_queue_name(prefix))
    outsider.control.shutdown()

    # Celery's built-in tasks are not registered: refused, not run.
    for name, args in (("celery.accumulate", [1, 2]), ("celery.map", [{"task": "x"}, [[1]]])):
        outsider.send_task(name, args=args, queue=model_q)
    outsider.send_task("celery.chord_unlock", args=["g", []], queue=model_q)
    # A delay, an expiry, a callback or an oversized body: refused at once, not held.
    job_id = f"batch_{uuid.uuid4().hex}"
    outsider.send_task(RUN_SHARD, args=[job_id, 0], countdown=3600, queue=model_q)
    outsider.send_task(RUN_SHARD, args=[job_id, 1], expires=3600, queue=model_q)
    outsider.send_task(SUBMIT_JOB, kwargs={"x": 1}, link=outsider.signature("celery.accumulate"), queue=model_q)
    outsider.send_task(SUBMIT_JOB, kwargs={"padding": "x" * (1536 * 1024)}, queue=model_q)

    expected = [
        "Received unregistered task of type 'celery.accumulate'",
        "Received unregistered task of type 'celery.map'",
        "Received unregistered task of type 'celery.chord_unlock'",
        "it has an 'eta' header",
        "it has an 'expires' header",
        "its embed asks for callbacks",
        "over the limit of 1048576 (CONVEYOR_MAX_MESSAGE_BYTES)",
    ]
    wait_for(lambda: all(line in worker.log() for line in expected), 30, "the refusals in the worker's log")
    log = worker.log()
    assert "succeeded" not in log and "ETA:" not in log, log[-3000:]

    # The worker still serves both of its queues: a submission runs to its end.
    example = load_example()
    with producer(stack) as conn, reply_queue(conn) as replies:
        example.submit(conn, {"input_uri": uri, "model": stack.model, "idempotency_key": "after", "reply_to": replies},
                       prefix)  # fmt: skip
        end = example.wait_for_end(conn, replies, "after", timeout=60)
    assert end["status"] == "completed" and end["batch"]["request_counts"]["completed"] == 2
    assert worker.proc.poll() is None
    client.close()


def test_a_failed_attempt_is_sent_again_without_a_delay_header(embedded_stack, monkeypatch) -> None:
    """Conveyor's own retries cannot use ``countdown`` (its queues refuse it): the task waits
    out the backoff itself, then sends the shard again as a plain message."""
    from kombu import Connection

    from conveyor.worker.broker import tasks
    from conveyor.worker.broker.app import create_app
    from conveyor.worker.execution.shard_runner import RetryShard

    def failing(ctx, job_id: str, shard_index: int):
        raise RetryShard("engine exploded", attempts=1)

    monkeypatch.setattr(tasks, "run_next_shard", failing)
    monkeypatch.setattr(tasks, "RETRY_BACKOFF", (0.3,))
    settings = embedded_stack.settings
    settings.ensure_home()
    app = create_app(settings)
    job_id = f"batch_{uuid.uuid4().hex}"
    result = app.tasks[RUN_SHARD].apply(args=[job_id, 3]).get()
    assert result == {"job_id": job_id, "shard_index": 3, "status": "retrying"}
    queue = model_queue(queue_name(canonical_model(embedded_stack.model), settings.queue_prefix))
    with Connection(settings.broker) as conn:
        message = queue(conn.default_channel).get(no_ack=True)
    assert message is not None and message.headers["task"] == RUN_SHARD
    assert message.headers.get("eta") is None and message.payload[0] == [job_id, 3]
    app.conveyor.close()


def test_every_worker_starts_without_mingle_gossip_or_heartbeat(embedded_stack, monkeypatch) -> None:
    """Also under plain ``celery -A conveyor.worker.app worker``, whose command line may not say so."""
    from celery.apps.worker import Worker

    from conveyor.worker.broker.app import create_app

    seen: dict = {}
    monkeypatch.setattr(Worker, "__init__", lambda self, *args, **kwargs: seen.update(kwargs))
    settings = embedded_stack.settings
    settings.ensure_home()
    app = create_app(settings)
    app.Worker(hostname="w@x", without_mingle=False, without_gossip=False)
    assert (seen["without_mingle"], seen["without_gossip"], seen["without_heartbeat"]) == (True, True, True)
    app.conveyor.close()
