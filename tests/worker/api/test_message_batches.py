"""Anthropic's Message Batches end to end, driven by the official ``anthropic`` SDK against
``conveyor serve`` (uvicorn, real HTTP) and a real worker on PostgreSQL + Redis + S3 (moto's
server): create, poll, list, results typed by the SDK, a malformed request that errors alone,
a cancel mid-batch, another key's 404s, delete; the batch-level 400s in Anthropic's shape; and a
reasoning model's thinking and a forced tool call as the SDK's blocks."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx2 as httpx
import pytest
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse

from conveyor.worker.store.objects.factory import open_store_from_settings
from tests.engine.reasoning_models import OPENS_THINK_TEMPLATE, build_reasoning_model
from tests.worker.api_batches import MODEL
from tests.worker.api_server import ApiServer
from tests.worker.helpers import SLOW_ENGINE, Stack, make_values

# Starts a worker process and serves HTTP: seconds (tests/markers.py).
pytestmark = pytest.mark.slow


def client_of(server: ApiServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60.0)


def params(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}], **extra}


def wait_ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 180.0) -> MessageBatch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.processing_status} after {timeout} s"
        time.sleep(0.2)


def results_of(client: anthropic.Anthropic, batch_id: str) -> dict[str, MessageBatchIndividualResponse]:
    lines = list(client.messages.batches.results(batch_id))
    assert all(isinstance(line, MessageBatchIndividualResponse) for line in lines)
    by_id = {line.custom_id: line for line in lines}
    assert len(by_id) == len(lines), "one result per request"
    return by_id


def test_the_sdk_creates_polls_reads_cancels_and_deletes_message_batches(
    pg_redis_s3_stack, serve, spawn_worker
) -> None:
    stack = pg_redis_s3_stack.with_values(models=[MODEL], engine_args=SLOW_ENGINE)
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    alice_key = server.new_key("alice")
    alice, bob = client_of(server, alice_key), client_of(server, server.new_key("bob"))
    worker.wait_ready()

    requests = [
        {"custom_id": "plain", "params": params("the chef", temperature=0.0, metadata={"user_id": "u1"})},
        {"custom_id": "image", "params": params("x") | {"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}},
        {"custom_id": "system-and-stop", "params": params(
            "soup", system=[{"type": "text", "text": "Be brief."}], stop_sequences=["zz"], top_k=5)},
    ]  # fmt: skip
    created = alice.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.request_counts.processing == 3 and created.expires_at > created.created_at

    batch = wait_ended(alice, created.id)
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 2, 1, 0, 0)
    assert batch.ended_at is not None and batch.results_url == f"{server.url}/v1/messages/batches/{batch.id}/results"
    results = results_of(alice, batch.id)
    assert set(results) == {"plain", "image", "system-and-stop"}
    for custom_id in ("plain", "system-and-stop"):
        result = results[custom_id].result
        assert result.type == "succeeded", result
        message = result.message
        assert message.id.startswith("msg_") and (message.type, message.role, message.model) == (
            "message", "assistant", MODEL,
        )  # fmt: skip
        assert [block.type for block in message.content] == ["text"]
        assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
        assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 8
    errored = results["image"].result
    assert errored.type == "errored" and errored.error.type == "error"
    assert errored.error.error.type == "invalid_request_error"
    assert "image blocks are not supported" in errored.error.error.message

    # Another key sees none of it; the key as x-api-key is as good as a bearer.
    for call in (
        lambda: bob.messages.batches.retrieve(batch.id),
        lambda: list(bob.messages.batches.results(batch.id)),
        lambda: bob.messages.batches.cancel(batch.id),
        lambda: bob.messages.batches.delete(batch.id),
    ):
        with pytest.raises(anthropic.NotFoundError) as caught:
            call()
        assert caught.value.body == {
            "type": "error",
            "error": {"type": "not_found_error", "message": f"No message batch found with id '{batch.id}'."},
        }  # fmt: skip
    assert list(bob.messages.batches.list()) == []
    raw = httpx.get(
        f"{server.url}/v1/messages/batches/{batch.id}",
        headers={"x-api-key": alice_key, "anthropic-version": "2023-06-01", "anthropic-beta": "anything"},
    )
    assert raw.status_code == 200 and raw.json()["id"] == batch.id
    assert not MessageBatch.model_validate(raw.json()).model_extra  # Anthropic's fields, no other
    assert set(raw.json()) == set(MessageBatch.model_fields)
    assert httpx.get(f"{server.url}/v1/messages/batches", headers={"x-api-key": "nope"}).json() == {
        "type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"},
    }  # fmt: skip

    # A cancel mid-batch: what finished stays, the rest is canceled.
    n = 16
    long = [{"custom_id": f"long-{i}", "params": params(f"story {i}", max_tokens=160)} for i in range(n)]
    running = alice.messages.batches.create(requests=long)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError, match="cannot be deleted while it is in_progress"):
        alice.messages.batches.delete(running.id)
    deadline = time.monotonic() + 120
    while alice.messages.batches.retrieve(running.id).request_counts.succeeded < 1:
        assert time.monotonic() < deadline, "the long batch's first result"
        time.sleep(0.2)
    canceling = alice.messages.batches.cancel(running.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    ended = wait_ended(alice, running.id)
    counts = ended.request_counts
    assert counts.succeeded >= 1 and counts.canceled >= 1 and counts.succeeded + counts.errored + counts.canceled == n
    kinds = [r.result.type for r in results_of(alice, running.id).values()]
    assert (
        len(kinds) == n and kinds.count("canceled") == counts.canceled and kinds.count("succeeded") == counts.succeeded
    )

    # The list pages newest first, both ways.
    assert [b.id for b in alice.messages.batches.list()] == [running.id, batch.id]
    page = alice.messages.batches.list(limit=1)
    assert ([b.id for b in page.data], page.has_more, page.first_id, page.last_id) == (
        [running.id], True, running.id, running.id,
    )  # fmt: skip
    older = alice.messages.batches.list(limit=1, after_id=running.id)
    assert ([b.id for b in older.data], older.has_more) == ([batch.id], False)
    newer = alice.messages.batches.list(limit=5, before_id=batch.id)
    assert ([b.id for b in newer.data], newer.has_more) == ([running.id], False)

    deleted = alice.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        alice.messages.batches.retrieve(batch.id)
    assert [b.id for b in alice.messages.batches.list()] == [running.id]


def _create_error(client: anthropic.Anthropic, requests: list[dict[str, Any]]) -> dict[str, Any]:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert isinstance(message, str)
    return {"message": message}


@pytest.mark.parametrize("server", [{"message_batch_max_requests": 3, "quota_queued_lines": 2}], indirect=True)
def test_a_batch_anthropic_would_refuse_is_a_400_in_anthropics_shape(server: ApiServer) -> None:
    client = client_of(server, server.new_key("carol"))
    good = {"custom_id": "ok", "params": params("hi")}
    assert (
        "custom_id: must be 1 to 64 characters"
        in _create_error(client, [good, {"custom_id": "has space", "params": params("hi")}])["message"]
    )
    assert "must be unique" in _create_error(client, [good, good])["message"]
    assert (
        "at most 3 requests"
        in _create_error(client, [{"custom_id": f"r{i}", "params": params("hi")} for i in range(4)])["message"]
    )
    assert (
        "several models"
        in _create_error(client, [good, {"custom_id": "other", "params": params("hi") | {"model": "another-model"}}])[
            "message"
        ]
    )
    assert (
        "is not served here"
        in _create_error(client, [{"custom_id": "a", "params": params("hi") | {"model": "nobody-serves-me"}}])[
            "message"
        ]
    )
    with pytest.raises(anthropic.BadRequestError) as listed:
        client.messages.batches.list(limit=1001)
    assert listed.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "Invalid value for 'limit': Input should be less than or equal to 1000",
    }}  # fmt: skip
    # The owner's quotas, as for any batch: 429, which the SDK raises as RateLimitError.
    with pytest.raises(anthropic.RateLimitError) as limited:
        too_many: list[Any] = [{"custom_id": f"q{i}", "params": params("hi")} for i in range(3)]
        client.messages.batches.create(requests=too_many)
    body = limited.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "queued request lines" in body["error"]["message"], body
    assert list(client.messages.batches.list()) == []  # nothing was created, nor kept
    assert list(open_store_from_settings(server.settings).list("jobs/")) == []


@pytest.fixture(scope="module")
def reasoning_model(tmp_path_factory) -> str:
    return str(build_reasoning_model(tmp_path_factory.mktemp("r1") / "m", OPENS_THINK_TEMPLATE))


def test_thinking_and_a_forced_tool_call_come_back_as_sdk_blocks(
    tmp_path, reasoning_model, serve, spawn_worker
) -> None:
    stack = Stack(make_values(tmp_path / "home", reasoning_model), reasoning_model)
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    client = client_of(server, server.new_key("dora"))
    worker.wait_ready()
    weather = {
        "name": "weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                         "additionalProperties": False},
    }  # fmt: skip
    requests = [
        {"custom_id": "think",
         "params": params("the chef", max_tokens=16, thinking={"type": "enabled", "budget_tokens": 3})},
        {"custom_id": "call", "params": params("weather?", max_tokens=48, tools=[weather],
                                               tool_choice={"type": "tool", "name": "weather"},
                                               thinking={"type": "enabled", "budget_tokens": 2})},
    ]  # fmt: skip
    batch = wait_ended(client, client.messages.batches.create(requests=requests).id)  # type: ignore[arg-type]
    assert batch.request_counts.succeeded == 2, batch.request_counts
    results = results_of(client, batch.id)

    thought = results["think"].result
    assert thought.type == "succeeded"
    first = thought.message.content[0]
    assert first.type == "thinking" and first.thinking and first.signature == ""
    assert thought.message.usage.output_tokens <= 16

    called = results["call"].result
    assert called.type == "succeeded" and called.message.stop_reason == "tool_use", called
    uses = [block for block in called.message.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "weather" and uses[0].input["city"] in ("Paris", "Oslo")
    assert uses[0].id.startswith("toolu_")
