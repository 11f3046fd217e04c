"""Broker submissions taken by the API server while no worker runs (``SubmissionConsumer``): a
plain kombu producer's message, sent twice, becomes one ``validating`` job (demand for its
model) with its intake queued, and its end (a cancel) is announced with no worker either;
what is not a submission is dropped, as Celery drops it; a database that is down sends the
message back to the queue. On Redis and RabbitMQ."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

from conveyor.worker.broker.config import celery_app
from conveyor.worker.broker.queues import DEFAULT_QUEUE, intake_queue_name, queue_depth, submit_queue_name
from conveyor.worker.broker.submission_consumer import SubmissionConsumer, Verdict
from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.lifecycle import cancel_job
from conveyor.worker.metrics.exposition import ApiMetrics
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Job, JobStatus
from conveyor.worker.store.objects.local import LocalStore
from tests.worker.api_server import ApiServer
from tests.worker.broker_messages import load_example, producer, publish_task, reply_queue
from tests.worker.helpers import Scrape, Stack, jsonl, openai_lines, wait_for


@pytest.mark.parametrize("stack_name", ["pg_redis_s3_stack", "pg_amqp_s3_stack"])
def test_the_api_takes_a_submission_twice_sent_as_one_job_while_no_worker_runs(
    request: pytest.FixtureRequest, stack_name: str
) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    stack = stack.with_values(metrics_cache_seconds=0.0, models=[stack.model])  # declared: taken with no worker
    settings = stack.settings
    prefix = settings.queue_prefix
    server = ApiServer(settings).start()
    app = celery_app(settings, DEFAULT_QUEUE)
    db = create_db_engine(settings.database)
    example = load_example()
    key = f"night-{uuid.uuid4().hex[:8]}"

    def jobs() -> list[tuple[str, JobStatus, str]]:
        with db.connect() as c:
            rows = c.execute(select(Job.id, Job.status, Job.model).where(Job.idempotency_key == key))
            return [(str(job_id), JobStatus(status), str(model)) for job_id, status, model in rows]

    try:
        store = server.app.state.services.store
        store.put_bytes("inputs/night.jsonl", jsonl(openai_lines(5)))
        with producer(stack) as conn, reply_queue(conn) as replies:
            fields = {
                "input_uri": store.uri("inputs/night.jsonl"), "model": stack.model, "idempotency_key": key,
                "reply_to": replies,
            }  # fmt: skip
            example.submit(conn, fields, prefix)
            example.submit(conn, fields, prefix)  # a retry: a new task id, the same key
            # What no worker could take either: dropped, and the consumer goes on.
            publish_task(conn, prefix, {"not": "a list"}, {"task": "conveyor.submit_job", "id": "t-bad-body"})
            publish_task(conn, prefix, [[], {}, {}], {"task": "conveyor.run_shard", "id": "t-other-task"})

            wait_for(lambda: queue_depth(app, submit_queue_name(prefix)) == 0 and jobs(), 30, "the submissions taken")
            [(job_id, status, model)] = jobs()
            assert status is JobStatus.validating and model == stack.model
            assert queue_depth(app, intake_queue_name(prefix)) in (1, 2)  # each copy sends the intake: harmless
            metrics = ApiMetrics(settings)
            m = Scrape.parse(metrics.render()[0].decode())
            metrics.close()
            assert m.value("conveyor_demand", model=stack.model) == 1  # what a trigger sees before any worker

            # Cancelled while still no worker runs: the API server announces the end itself.
            assert cancel_job(db, store, job_id)["status"] == "cancelled"
            end = example.wait_for_end(conn, replies, key, timeout=30)
            assert end["status"] == "cancelled" and end["job_id"] == job_id
    finally:
        server.stop()
        app.close()
        db.dispose()


def test_a_database_that_is_down_sends_the_submission_back(tmp_path) -> None:
    settings = Settings(
        home=tmp_path / "home",
        database_url="postgresql://nobody@127.0.0.1:9/none?connect_timeout=2",  # nothing listens on port 9
        storage_url=(tmp_path / "objects").as_uri(),
    )
    db = create_db_engine(settings.database)
    consumer = SubmissionConsumer(celery_app(settings, DEFAULT_QUEUE), db, LocalStore(tmp_path / "objects"), settings)
    fields = {"input_uri": (tmp_path / "objects" / "x.jsonl").as_uri(), "model": "org/m", "idempotency_key": "k-1"}
    headers = {"task": "conveyor.submit_job", "id": "t-1"}
    try:
        assert consumer.take(headers, [[], fields, {}]) is Verdict.requeue
        assert consumer.take({"task": "conveyor.submit_job"}, [[], fields, {}]) is Verdict.reject  # no id
        assert consumer.take(headers, [[], {"model": "org/m"}, {}]) is Verdict.ack  # refused, unrecordable: logged
    finally:
        db.dispose()
