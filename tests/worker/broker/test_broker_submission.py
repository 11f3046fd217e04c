"""Broker-level submission and completion announcements, end to end: the docs' producer
(``examples/broker_producer.py``, plain kombu, no conveyor import) submits jobs by message to
a real worker subprocess over Redis and RabbitMQ, and hears each job's end on its own queue."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.jobs.submission import SubmitOptions, create_job
from conveyor.worker.store.models import Job, Shard
from tests.worker.broker_messages import EXAMPLE, drain, load_example, producer, publish_task, reply_queue, upload
from tests.worker.helpers import REPO, Stack, assert_each_request_once, openai_lines, wait_for


def jobs_with_key(client: Client, key: str) -> list[Any]:  # rows of the jobs table
    with client.db.connect() as conn:
        return list(conn.execute(select(Job).where(Job.idempotency_key == key)).all())


def test_the_docs_show_the_example_producer_as_it_runs() -> None:
    text = (REPO / "docs/user-guide/broker.md").read_text()
    marker = "<!-- broker-producer -->"
    assert marker in text, "docs/user-guide/broker.md lost its broker producer"
    block = re.search(r"```python\n(.*?)```", text[text.index(marker) :], re.S)
    assert block is not None
    example = load_example()
    for function in (example.submit, example.wait_for_end):
        assert inspect.getsource(function) in block.group(1), f"the docs' {function.__name__} is not the example's"
    assert "import worker" not in EXAMPLE.read_text() and "from worker" not in EXAMPLE.read_text()


@pytest.mark.parametrize("stack_name", ["pg_redis_s3_stack", "pg_amqp_s3_stack"])
def test_a_kombu_producer_submits_twice_and_hears_the_end_once(
    request: pytest.FixtureRequest, stack_name: str, spawn_worker
) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    prefix = stack.values["queue_prefix"]
    n = 6  # two shards of 4 (FAST shard size)
    client = Client(stack.settings)
    uri = upload(client, openai_lines(n))
    assert uri.startswith("s3://")
    example = load_example()
    worker = spawn_worker(stack)
    worker.wait_ready()
    key = f"nightly-{uuid.uuid4().hex[:8]}"
    # (each key hears its end on a queue of its own: the example's wait drops other keys' ends,
    # and which of the two jobs ends first is the fair share's choice, not this test's)
    with producer(stack) as conn, reply_queue(conn) as replies, reply_queue(conn) as crashed_replies:
        fields = {
            "input_uri": uri, "model": stack.model, "idempotency_key": key, "reply_to": replies,
            "metadata": {"run": "nightly"},
        }  # fmt: skip
        task_id = example.submit(conn, fields, prefix)
        example.submit(conn, fields, prefix)  # the producer resends (a retry): a new task id
        # and a redelivery of the first message: the same task id again
        publish_task(conn, prefix, [[], fields, {}], {"lang": "py", "task": "conveyor.submit_job", "id": task_id})
        # A worker that died after recording a job, before sending its intake: the message is
        # delivered again (late acks) and the job, still validating, is taken up.
        crashed = f"crashed-{uuid.uuid4().hex[:8]}"
        # (made as the message below would have made it: a key names one submission)
        orphan, _ = create_job(
            client.db, client.store, client.settings, uri, SubmitOptions(model=stack.model),
            metadata={"run": "nightly"}, idempotency_key=crashed, notify={"queue": crashed_replies},
        )  # fmt: skip
        example.submit(conn, {**fields, "idempotency_key": crashed, "reply_to": crashed_replies}, prefix)
        end = example.wait_for_end(conn, replies, key, timeout=120)
        taken_up = example.wait_for_end(conn, crashed_replies, crashed, timeout=120)
        later = drain(conn, replies, 3.0) + drain(conn, crashed_replies, 1.0)  # the duplicates announce nothing more
    assert later == []
    assert taken_up["job_id"] == orphan["id"] and taken_up["status"] == "completed"
    assert len(jobs_with_key(client, crashed)) == 1
    assert end["event"] == "batch.completed" and end["status"] == "completed"
    assert end["idempotency_key"] == key
    batch = end["batch"]
    assert batch["id"] == end["job_id"] and batch["metadata"] == {"run": "nightly"}
    assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
    assert batch["output_file_id"] and batch["output_uri"].startswith("s3://")
    assert len(jobs_with_key(client, key)) == 1  # one job for three messages
    job = client.status(end["job_id"])
    assert_each_request_once(client, client.db, job, n)
    with client.db.connect() as c:
        assert c.execute(select(func.count()).select_from(Shard).where(Shard.job_id == job["id"])).scalar_one() == 2
        assert c.execute(select(Job.notified_at).where(Job.id == job["id"])).scalar_one() is not None
    client.close()


def test_the_example_script_runs_as_the_readme_shows(pg_amqp_s3_stack, spawn_worker, tmp_path) -> None:
    """``python examples/broker_producer.py ...`` from the docs, as a separate process."""
    stack = pg_amqp_s3_stack
    client = Client(stack.settings)
    uri = upload(client, openai_lines(3), key="inputs/script.jsonl")
    worker = spawn_worker(stack)
    worker.wait_ready()
    replies = f"replies-{uuid.uuid4().hex[:10]}"
    argv = [
        sys.executable, str(EXAMPLE), "--broker", stack.values["broker_url"],
        "--prefix", stack.values["queue_prefix"], "--input", uri, "--model", stack.model,
        "--key", "script-1", "--reply-to", replies, "--timeout", "120",
    ]  # fmt: skip
    env = {k: v for k, v in stack.env().items() if not k.startswith("CONVEYOR_")}
    env.pop("PYTHONPATH", None)  # it needs only kombu
    try:
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    finally:
        with producer(stack) as conn:
            conn.default_channel.queue_delete(replies)
    assert done.returncode == 0, done.stderr + worker.log()[-3000:]
    end = json.loads(done.stdout)
    assert end["status"] == "completed" and end["batch"]["request_counts"]["completed"] == 3
    client.close()


def test_bad_messages_are_refused_with_a_reason_and_the_worker_keeps_serving(pg_redis_s3_stack, spawn_worker) -> None:
    stack = pg_redis_s3_stack
    prefix = stack.values["queue_prefix"]
    client = Client(stack.settings)
    uri = upload(client, openai_lines(2))
    root = client.store.uri()
    example = load_example()
    worker = spawn_worker(stack)
    worker.wait_ready()
    good = {"input_uri": uri, "model": stack.model}
    refused = {  # key -> (fields, the field at fault, what the reason says)
        "outside-file": ({**good, "input_uri": "file:///etc/passwd"}, "input_uri", "not an object in this store"),
        "outside-bucket": ({**good, "input_uri": "s3://some-other-bucket/x.jsonl"}, "input_uri", "not an object in"),
        "own-objects": (
            {**good, "input_uri": f"{root}/jobs/batch_{'0' * 32}/results.jsonl"},
            "input_uri",
            "own job objects",
        ),
        "missing-input": ({**good, "input_uri": f"{root}/inputs/missing.jsonl"}, "input_uri", "there is no object"),
        "no-model": ({"input_uri": uri}, "model", "model is required"),
        "bad-priority": ({**good, "priority": "high"}, "priority", "priority must be an integer"),
        "typo": ({**good, "modle": "x"}, "modle", "unknown field(s) modle"),
        "bad-metadata": ({**good, "metadata": {"k": 1}}, "metadata", "'metadata.k': expected a string"),
        "bad-window": ({**good, "completion_window": "2w"}, "completion_window", "completion window must be"),
    }
    with producer(stack) as conn, reply_queue(conn) as replies:
        for key, (fields, _, _) in refused.items():
            example.submit(conn, {**fields, "idempotency_key": key, "reply_to": replies}, prefix)
        example.submit(conn, {**good, "idempotency_key": "outside-file", "reply_to": replies}, prefix)  # same key
        # Refused without an announcement: no valid reply target, or no key to record it under.
        example.submit(conn, {**good, "idempotency_key": "reserved", "reply_to": f"{prefix}-submit"}, prefix)
        example.submit(conn, {**good, "reply_to": replies}, prefix)
        headers = {"lang": "py", "task": "conveyor.submit_job", "id": str(uuid.uuid4())}
        publish_task(conn, prefix, [[uri, stack.model], {}, {}], headers)  # positional arguments
        publish_task(conn, prefix, "not a celery body", headers)  # not [args, kwargs, embed]
        publish_task(conn, prefix, [[], good, {}], {"task": "conveyor.submit_job"})  # no task id
        publish_task(conn, prefix, {"nothing": "here"}, {})  # not a task at all
        got: dict[str, dict] = {}
        deadline = time.monotonic() + 60
        while len(got) < len(refused) and time.monotonic() < deadline:
            for message in drain(conn, replies, 1.0):
                key = message["body"]["idempotency_key"]
                assert key not in got, f"announced twice: {key}"
                got[key] = message
        # The worker still serves: a good submission runs to its end.
        example.submit(conn, {**good, "idempotency_key": "good", "reply_to": replies}, prefix)
        end = example.wait_for_end(conn, replies, "good", timeout=60)
        assert drain(conn, replies, 1.0) == []
    assert end["status"] == "completed" and end["batch"]["request_counts"]["completed"] == 2
    assert worker.proc.poll() is None
    assert set(got) == set(refused)
    for key, (_, param, reason) in refused.items():
        message = got[key]
        body = message["body"]
        assert message["content_type"] == "application/json"
        assert message["properties"]["message_id"] == f"{body['job_id']}:failed"
        assert message["properties"]["correlation_id"] == key
        assert body["event"] == "batch.failed" and body["status"] == "failed"
        (error,) = body["batch"]["errors"]["data"]
        assert error["code"] == "invalid_submission" and error["param"] == param, (key, error)
        assert reason in error["message"], (key, error)
        assert len(jobs_with_key(client, key)) == 1
    (reserved,) = wait_for(lambda: jobs_with_key(client, "reserved"), 10, "the refusal")  # nowhere to announce it
    assert reserved.status == "failed" and reserved.notify is None and "reserved" in reserved.errors[0]["message"]
    log = worker.log()
    assert "idempotency_key is required" in log and "keyword arguments only" in log
    client.close()


def test_a_cancel_or_an_expiry_is_announced_too(pg_redis_s3_stack, spawn_worker) -> None:
    """Jobs that end outside a worker's task: cancelled from the client (the periodic pass
    announces it), expired by a worker's expiry thread. Their model is served by no worker,
    so they never run; any worker ingests them."""
    unserved = "conveyor-test/nobody-serves-this"  # declared in the catalog, served by no worker
    stack = pg_redis_s3_stack.with_values(min_completion_window_seconds=1, models=[unserved])
    prefix = stack.values["queue_prefix"]
    client = Client(stack.settings)
    uri = upload(client, openai_lines(3))
    example = load_example()
    worker = spawn_worker(stack)
    worker.wait_ready()
    with producer(stack) as conn, reply_queue(conn) as replies:
        base = {"input_uri": uri, "model": unserved, "reply_to": replies}
        example.submit(conn, {**base, "idempotency_key": "to-cancel"}, prefix)
        example.submit(conn, {**base, "idempotency_key": "to-expire", "completion_window": "4s"}, prefix)
        (job,) = wait_for(lambda: jobs_with_key(client, "to-cancel"), 30, "the job")
        wait_for(lambda: client.status(job.id)["status"] == "in_progress", 30, "the intake")
        assert client.cancel(job.id)["status"] == "cancelled"
        cancelled = example.wait_for_end(conn, replies, "to-cancel", timeout=30)
        expired = example.wait_for_end(conn, replies, "to-expire", timeout=30)
    assert cancelled["event"] == "batch.cancelled" and cancelled["job_id"] == job.id
    # None ran: each is a batch_cancelled error, so the counts add up to the input.
    assert cancelled["batch"]["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert expired["event"] == "batch.expired"
    assert expired["batch"]["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    client.close()
