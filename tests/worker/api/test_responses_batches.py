"""``/v1/responses`` batches through the Files and Batches API, driven by the ``openai`` SDK against
``conveyor serve`` and a real worker serving a tiny reasoning model (a template that opens
``<think>``): every result line validates as the SDK's ``Response``."""

from __future__ import annotations

import json

import pytest

from tests.engine.reasoning_models import OPENS_THINK_TEMPLATE, build_reasoning_model
from tests.worker.api_batches import MODEL, wait_batch
from tests.worker.helpers import Stack, jsonl, make_values
from tests.worker.openai_shapes import check_output_line

RESPONSES = "/v1/responses"
# Starts a worker process and serves HTTP: seconds (tests/markers.py).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reasoning_model(tmp_path_factory) -> str:
    return str(build_reasoning_model(tmp_path_factory.mktemp("r1") / "m", OPENS_THINK_TEMPLATE))


def test_the_sdk_runs_a_responses_batch(tmp_path, reasoning_model, serve, spawn_worker) -> None:
    stack = Stack(make_values(tmp_path / "home", reasoning_model), reasoning_model)
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    client = server.client(server.new_key("alice"))
    worker.wait_ready()
    bodies = [
        {"model": MODEL, "input": "the chef", "max_output_tokens": 16, "thinking_token_budget": 3, "temperature": 0},
        {"model": MODEL, "input": "soup", "instructions": "answer in JSON", "max_output_tokens": 40,
         "thinking_token_budget": 2, "text": {"format": {"type": "json_schema", "name": "o", "schema": {
             "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}}}, "temperature": 0},
        {"model": MODEL, "input": "x", "previous_response_id": "resp_abc"},
    ]  # fmt: skip
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": RESPONSES, "body": b} for i, b in enumerate(bodies)]
    uploaded = client.files.create(file=("responses.jsonl", jsonl(lines)), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint=RESPONSES, completion_window="24h")
    batch = wait_batch(client, created.id)
    assert batch.status == "completed" and batch.endpoint == RESPONSES, batch
    assert batch.output_file_id and batch.error_file_id
    results = [check_output_line(t, results=True) for t in client.files.content(batch.output_file_id).text.splitlines()]
    by_id = {r.custom_id: r.response.body for r in results if r.response is not None}
    assert set(by_id) == {"r0", "r1"}
    first = by_id["r0"]
    assert [o["type"] for o in first["output"]] == ["reasoning", "message"]
    assert first["usage"]["output_tokens_details"]["reasoning_tokens"] == 3 and first["model"] == MODEL
    answer = next(o for o in by_id["r1"]["output"] if o["type"] == "message")["content"][0]["text"]
    assert json.loads(answer) in ({"ok": True}, {"ok": False}) and by_id["r1"]["instructions"] == "answer in JSON"
    # The batch's usage sums the lines' thinking.
    thinking = sum(body["usage"]["output_tokens_details"]["reasoning_tokens"] for body in by_id.values())
    assert batch.usage is not None and batch.usage.output_tokens_details.reasoning_tokens == thinking == 3 + 2
    errors = [check_output_line(t, results=False) for t in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e.custom_id, e.error and e.error.code) for e in errors] == [("r2", "unsupported")]
    assert errors[0].error is not None and "stateless" in (errors[0].error.message or "")
