"""Plain kombu on the stack's broker, as a producer outside Conveyor has it: the example producer,
reply queues, raw messages."""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from kombu import Connection, Exchange, Queue

from conveyor.worker.entrypoints.client import Client
from tests.worker.helpers import REPO, Stack, jsonl

EXAMPLE = REPO / "examples" / "broker_producer.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("broker_producer", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def producer(stack: Stack) -> Iterator[Connection]:
    """A plain kombu connection to the stack's broker (as a producer outside Conveyor has)."""
    options = stack.values.get("broker_transport_options") or {}
    with Connection(stack.values["broker_url"], transport_options=options) as conn:
        yield conn


@contextmanager
def reply_queue(conn: Connection) -> Iterator[str]:
    name = f"replies-{uuid.uuid4().hex[:10]}"
    Queue(name, durable=True)(conn.default_channel).declare()
    try:
        yield name
    finally:
        with suppress(Exception):
            conn.default_channel.queue_delete(name)


def drain(conn: Connection, queue: str, seconds: float) -> list[dict]:
    """Every message that arrives on ``queue`` within ``seconds`` (acknowledged)."""
    got: list[dict] = []

    def on_message(body: dict, message: Any) -> None:
        got.append({"body": body, "properties": dict(message.properties), "content_type": message.content_type})
        message.ack()

    deadline = time.monotonic() + seconds
    with conn.Consumer(Queue(queue), callbacks=[on_message], accept=["json"]):
        while time.monotonic() < deadline:
            with suppress(TimeoutError):
                conn.drain_events(timeout=max(0.05, min(0.5, deadline - time.monotonic())))
    return got


def publish_task(conn: Connection, prefix: str, body: Any, headers: dict) -> None:
    """A raw message on the submission queue (what a broken or foreign producer may send)."""
    name = f"{prefix}-submit"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name, durable=True)
    with conn.Producer() as p:
        p.publish(body, exchange=queue.exchange, routing_key=name, declare=[queue], serializer="json", headers=headers)


def upload(client: Client, rows: list, key: str = "inputs/requests.jsonl") -> str:
    """Put ``rows`` as a JSONL input in the client's store; its URI, for a submission."""
    client.store.put_bytes(key, jsonl(rows))
    return client.store.uri(key)
