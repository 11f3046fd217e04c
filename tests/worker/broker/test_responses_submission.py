"""``/v1/responses`` lines through the broker door: a plain kombu producer submits a file of them
to a worker serving a tiny reasoning model; every result validates as the SDK's ``Response``."""

from __future__ import annotations

import json
import uuid

import pytest
from openai.types.responses import Response

from conveyor.worker.entrypoints.client import Client
from tests.engine.reasoning_models import OPENS_THINK_TEMPLATE, build_reasoning_model
from tests.worker.broker_messages import load_example, producer, reply_queue, upload
from tests.worker.helpers import Stack, make_values

# Starts a worker process: seconds (tests/markers.py).
pytestmark = pytest.mark.slow


def test_a_kombu_producer_submits_responses_lines(tmp_path, spawn_worker) -> None:
    model = str(build_reasoning_model(tmp_path / "model", OPENS_THINK_TEMPLATE))
    stack = Stack(make_values(tmp_path / "home", model), model)
    # The embedded broker (kombu's SQLAlchemy transport on SQLite), named for the plain producer.
    stack = stack.with_values(broker_url=stack.settings.broker)
    client = Client(stack.settings)
    rows = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
         "body": {"input": f"the chef {i}", "max_output_tokens": 12, "thinking_token_budget": 2, "temperature": 0}}
        for i in range(3)
    ]  # fmt: skip
    uri = upload(client, rows)
    worker = spawn_worker(stack)
    worker.wait_ready()
    example = load_example()
    key = f"responses-{uuid.uuid4().hex[:8]}"
    with producer(stack) as conn, reply_queue(conn) as replies:
        example.submit(conn, {"input_uri": uri, "model": model, "idempotency_key": key, "reply_to": replies},
                       stack.values["queue_prefix"])  # fmt: skip
        end = example.wait_for_end(conn, replies, key, timeout=120)
    assert end["status"] == "completed" and end["batch"]["endpoint"] == "/v1/responses"
    results = [json.loads(line) for line in client.result_bytes(end["job_id"])]
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r2"]
    for r in results:
        response = Response.model_validate(r["response"]["body"])
        assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 2
    assert end["batch"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    client.close()
