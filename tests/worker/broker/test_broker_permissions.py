"""The RabbitMQ permissions that docs/operations/security.md gives, checked on a real broker: a
producer allowed only to write to the submission exchange (and to keep its own reply queues)
submits a job and hears its end from a worker that has only the workers' permissions, and is
refused everything else. Needs ``rabbitmqctl`` on the machine (to add the two users)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import suppress

import pytest
from kombu import Connection, Exchange, Queue

from conveyor.worker.broker.queues import SUBMIT_JOB, queue_name
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.jobs.model_names import canonical_model
from tests.worker.broker_messages import load_example, upload
from tests.worker.helpers import openai_lines

HOST = "127.0.0.1:5672"


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def users(pg_amqp_s3_stack) -> Iterator[dict[str, str]]:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("no rabbitmqctl here to add the broker users")
    prefix = pg_amqp_s3_stack.values["queue_prefix"]
    suffix = uuid.uuid4().hex[:8]
    names = {"producer": f"producer-{suffix}", "worker": f"worker-{suffix}"}
    perms = {  # as docs/operations/security.md gives them, for this test's queue prefix
        "producer": (r"^replies\..*", f"^{prefix}-submit$", r"^replies\..*"),
        "worker": (f"^({prefix}-.*|replies\\..*)$", f"^({prefix}-.*|amq\\.default|replies\\..*)$", f"^{prefix}-.*"),
    }
    try:
        for role, name in names.items():
            _ctl("add_user", name, "pw")
            _ctl("set_permissions", "-p", "/", name, *perms[role])
        yield {role: f"amqp://{name}:pw@{HOST}//" for role, name in names.items()}
    finally:
        for name in names.values():
            with suppress(subprocess.CalledProcessError):
                _ctl("delete_user", name)


def _publish(conn: Connection, exchange: str, body: list, task: str = SUBMIT_JOB) -> None:
    with conn.Producer() as producer:
        producer.publish(
            body, exchange=Exchange(exchange, type="direct"), routing_key=exchange, serializer="json",
            headers={"task": task, "id": str(uuid.uuid4())},
        )  # fmt: skip


def test_a_producer_with_the_documented_permissions_submits_and_nothing_else(
    pg_amqp_s3_stack, users, spawn_worker
) -> None:
    stack = pg_amqp_s3_stack.with_values(reply_to_prefix="replies.")
    prefix = stack.values["queue_prefix"]
    client = Client(stack.settings)
    uri = upload(client, openai_lines(2))
    worker = spawn_worker(stack, broker_url=users["worker"])
    worker.wait_ready()
    replies = f"replies.{uuid.uuid4().hex[:8]}"
    example = load_example()
    fields = {"input_uri": uri, "model": stack.model, "idempotency_key": "perm", "reply_to": replies}
    # confirm_publish: a publish the broker refuses raises here, not later.
    with Connection(users["producer"], transport_options={"confirm_publish": True}) as conn:
        Queue(replies, durable=True)(conn.default_channel).declare()
        _publish(conn, f"{prefix}-submit", [[], fields, {}])  # the queue was declared by the worker
        end = example.wait_for_end(conn, replies, "perm", timeout=60)
        assert end["status"] == "completed" and end["batch"]["request_counts"]["completed"] == 2
        model_exchange = queue_name(canonical_model(stack.model), prefix)
        for exchange in (model_exchange, f"{prefix}-intake", "celery.pidbox"):
            with pytest.raises(Exception, match=r"ACCESS_REFUSED"):
                _publish(conn.clone(), exchange, [["batch_x", 0], {}, {}], "conveyor.run_shard")
        with pytest.raises(Exception, match=r"ACCESS_REFUSED"):
            conn.clone().default_channel.queue_purge(f"{prefix}-submit")
    with suppress(Exception), Connection(f"amqp://guest:guest@{HOST}//") as admin:
        admin.default_channel.queue_delete(replies)
    assert worker.proc.poll() is None
    client.close()
