"""Submit a Conveyor job through the broker and wait for its end, with plain kombu.

It imports nothing from Conveyor: any producer that can publish a Celery protocol-2 JSON
message can do the same. The input must already be in Conveyor's object store (under
CONVEYOR_STORAGE_URL). Prints the announcement of the job's end; exits 0 if it completed.

    python examples/broker_producer.py --broker redis://localhost:6379/0 \
        --input s3://my-bucket/conveyor/inputs/requests.jsonl --model Qwen/Qwen3-0.6B \
        --key nightly-2026-11-23 --reply-to nightly-replies
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from kombu import Connection, Exchange, Queue


def submit(conn: Connection, fields: dict, prefix: str = "conveyor") -> str:
    """Publish ``conveyor.submit_job(**fields)`` on ``<prefix>-submit``; returns the task id.
    Sending it again with the same ``idempotency_key`` is safe: it finds the same job."""
    name = f"{prefix}-submit"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name, durable=True)
    task_id = str(uuid.uuid4())
    with conn.Producer() as producer:
        producer.publish(
            [[], fields, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}],
            exchange=queue.exchange,
            routing_key=name,
            declare=[queue],
            serializer="json",  # content_type application/json, content_encoding utf-8
            delivery_mode=2,  # persistent
            correlation_id=task_id,
            headers={"lang": "py", "task": "conveyor.submit_job", "id": task_id, "root_id": task_id},
            retry=True,
        )
    return task_id


def wait_for_end(conn: Connection, reply_to: str, key: str, timeout: float) -> dict:
    """The announcement of the job submitted under ``key``, from the queue ``reply_to``
    (delivery is at least once: a repeat has the same message_id). TimeoutError if none."""
    found: list[dict] = []

    def on_message(body: dict, message) -> None:
        message.ack()
        if body.get("idempotency_key") == key and not found:
            found.append(body)

    deadline = time.monotonic() + timeout
    with conn.Consumer(Queue(reply_to), callbacks=[on_message], accept=["json"]):
        while not found:
            try:
                conn.drain_events(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except TimeoutError:  # (socket.timeout)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no announcement for {key!r} on {reply_to!r} after {timeout} s") from None
    return found[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", required=True, help="the broker URL Conveyor's workers use")
    parser.add_argument("--transport-options", type=json.loads, default={}, help="kombu transport options (JSON)")
    parser.add_argument("--prefix", default="conveyor", help="CONVEYOR_QUEUE_PREFIX of the workers")
    parser.add_argument("--input", required=True, help="the input's URI, under the object store")
    parser.add_argument("--model", required=True)
    parser.add_argument("--key", default=None, help="the idempotency key (reuse it to resend safely)")
    parser.add_argument("--reply-to", required=True, help="the queue to hear the job's end on")
    parser.add_argument("--metadata", type=json.loads, default=None, help="OpenAI batch metadata (JSON)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    key = args.key or f"example-{uuid.uuid4()}"
    fields = {"input_uri": args.input, "model": args.model, "idempotency_key": key, "reply_to": args.reply_to}
    if args.metadata is not None:
        fields["metadata"] = args.metadata
    with Connection(args.broker, transport_options=args.transport_options) as conn:
        Queue(args.reply_to, durable=True)(conn.default_channel).declare()  # before the job can end
        task_id = submit(conn, fields, args.prefix)
        print(f"submitted {key!r} (task {task_id}); waiting on {args.reply_to!r}", file=sys.stderr)
        end = wait_for_end(conn, args.reply_to, key, args.timeout)
    print(json.dumps(end, indent=2))
    return 0 if end["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
