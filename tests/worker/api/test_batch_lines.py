"""An API batch runs only lines of its endpoint, and every line it holds is charged, end to
end: the ``openai`` SDK against ``conveyor serve`` and one worker on PostgreSQL, Redis and S3.

A plain dataset row (``prompt``, ``input``, ``messages``) used to run inside a chat batch as a
text completion or as embeddings, and a UTF-8 byte order mark made the upload's scan skip
line 1 (charged nothing) while intake ran it."""

from __future__ import annotations

import json
from typing import Any, Final

import openai
import pytest
from sqlalchemy import select

from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Job
from tests.worker.api_batches import MODEL, batch_lines, wait_batch

CHAT: Final = "/v1/chat/completions"
DEFAULT_MAX_TOKENS = 100


@pytest.fixture
def api(pg_redis_s3_stack, serve, spawn_worker):
    stack = pg_redis_s3_stack.with_values(models=[MODEL], default_max_tokens=DEFAULT_MAX_TOKENS)
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    client = server.client(server.new_key("tenant"))
    worker.wait_ready(120)
    return server, client


def dumps(rows: list[Any]) -> bytes:
    return b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)


def create(client: openai.OpenAI, data: bytes) -> str:
    file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id


def charge(server: Any, batch_id: str) -> tuple[int | None, int | None]:
    db = create_db_engine(server.settings.database)
    try:
        with db.connect() as conn:
            row = conn.execute(select(Job.charged_lines, Job.charged_tokens).where(Job.id == batch_id)).one()
    finally:
        db.dispose()
    return row.charged_lines, row.charged_tokens


def test_plain_rows_are_line_errors_and_a_bom_line_is_charged_and_run(api) -> None:
    server, client = api
    bom, good = batch_lines(2, max_tokens=8)
    bom["custom_id"], good["custom_id"] = "bom", "good"
    plain: list[dict[str, Any]] = [
        {"custom_id": "plain-prompt", "prompt": "Once upon", "max_tokens": 5},  # ran as a text completion
        {"custom_id": "plain-input", "input": "embed me"},  # ran as embeddings
        {"custom_id": "plain-messages", "messages": [{"role": "user", "content": "hi"}]},
        {"custom_id": "url-column", "url": CHAT, "prompt": "a url, but no body"},
    ]
    data = b"\xef\xbb\xbf" + dumps([bom, *plain, good])
    batch_id = create(client, data)
    # Every line is charged from creation: the two requests their max_tokens, the rest the default.
    assert charge(server, batch_id) == (6, 2 * 8 + 4 * DEFAULT_MAX_TOKENS)

    batch = wait_batch(client, batch_id, timeout=180)
    assert batch.status == "completed" and batch.endpoint == CHAT
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 2, 4)
    assert batch.output_file_id is not None and batch.error_file_id is not None
    results = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert {r["custom_id"] for r in results} == {"bom", "good"}
    assert all(r["response"]["body"]["object"] == "chat.completion" for r in results)
    error_lines = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    errors: dict[str, dict[str, Any]] = {line["custom_id"]: line["error"] for line in error_lines}
    assert set(errors) == {row["custom_id"] for row in plain}
    for custom_id in ("plain-prompt", "plain-input", "plain-messages"):
        assert errors[custom_id]["code"] == "url_mismatch", errors[custom_id]
        assert "plain dataset row" in errors[custom_id]["message"] and CHAT in errors[custom_id]["message"]
    assert errors["url-column"]["code"] == "missing_prompt" and "body" in errors["url-column"]["message"]
    assert charge(server, batch_id) == (6, 416)  # intake keeps the charge the batch was created with


def test_another_endpoints_line_never_runs(api) -> None:
    _, client = api
    embed = {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "x"}}
    for data in (dumps([*batch_lines(1), embed]), b"\xef\xbb\xbf" + dumps([embed, *batch_lines(1)])):
        file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
        with pytest.raises(openai.BadRequestError) as caught:
            client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        assert caught.value.code == "mismatched_endpoint" and "/v1/embeddings" in caught.value.message
    assert client.batches.list().data == []
