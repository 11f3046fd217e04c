"""The HTTP API end to end, driven by the official ``openai`` SDK against ``conveyor serve``'s app
(uvicorn, real HTTP) and real workers: upload, create, poll, download; errors file, cancel
mid-way, expiry; on embedded defaults and on PostgreSQL + Redis + S3 (moto's server)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types import FileObject
from sqlalchemy import select

from conveyor.worker.broker.queues import queue_name
from conveyor.worker.jobs.model_names import canonical_model
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Worker
from tests.worker.api_batches import CHAT, MODEL, batch_lines, check_api_batch, raw_batch, wait_batch
from tests.worker.helpers import SLOW_ENGINE, jsonl, scrape, wait_for
from tests.worker.openai_shapes import check_output_line

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


@pytest.fixture(params=["embedded", "pg_redis_s3"])
def api_stack(request: pytest.FixtureRequest):
    return request.getfixturevalue("embedded_stack" if request.param == "embedded" else "pg_redis_s3_stack")


def lines_of(client: openai.OpenAI, file_id: str) -> list[str]:
    return client.files.content(file_id).text.splitlines()


def test_the_sdk_uploads_creates_polls_and_downloads_a_batch(api_stack, serve, spawn_worker) -> None:
    worker = spawn_worker(api_stack, served_model_name=MODEL)
    server = serve(api_stack)
    client = server.client(server.new_key("alice"))
    worker.wait_ready()
    assert MODEL in [m.id for m in client.models.list()]
    assert client.models.retrieve(MODEL).owned_by == "conveyor"
    db = create_db_engine(api_stack.settings.database)
    try:  # the worker serves the checkpoint under the public name, on that name's queue
        with db.connect() as conn:
            row = conn.execute(select(Worker.model, Worker.checkpoint, Worker.queue)).one()
    finally:
        db.dispose()
    assert tuple(row) == (MODEL, canonical_model(api_stack.model), queue_name(MODEL, api_stack.values["queue_prefix"]))

    good = batch_lines(5)
    hot = {**good[4], "custom_id": "hot", "body": {**good[4]["body"], "temperature": 9}}  # a bad value
    rows = [*good[:2], b"{not json", *good[2:4], hot, good[4]]
    uploaded = client.files.create(file=("requests.jsonl", jsonl(rows)), purpose="batch")
    assert isinstance(uploaded, FileObject) and not uploaded.model_extra
    assert (uploaded.purpose, uploaded.filename, uploaded.bytes) == ("batch", "requests.jsonl", len(jsonl(rows)))
    assert client.files.retrieve(uploaded.id) == uploaded
    assert client.files.content(uploaded.id).content == jsonl(rows)

    created = client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"team": "soup"}
    )
    assert created.status == "validating" and created.input_file_id == uploaded.id and created.model == MODEL
    batch = wait_batch(client, created.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 5, 2)
    assert batch.metadata == {"team": "soup"} and batch.endpoint == CHAT and batch.errors is None
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert isinstance(getattr(batch, stamp), int), stamp
    assert batch.usage is not None and batch.usage.input_tokens > 0 and batch.usage.output_tokens > 0
    assert batch.output_file_id and batch.error_file_id

    results = [check_output_line(text, results=True) for text in lines_of(client, batch.output_file_id)]
    assert [r.custom_id for r in results] == [f"req-{i}" for i in range(5)]
    assert all(r.response is not None and r.response.body["model"] == MODEL for r in results)
    errors = [check_output_line(text, results=False) for text in lines_of(client, batch.error_file_id)]
    assert [(e.custom_id, e.error and e.error.line) for e in errors] == [("line-3", 3), ("hot", 6)]

    output = client.files.retrieve(batch.output_file_id)
    assert (output.purpose, output.filename) == ("batch_output", f"{batch.id}_output.jsonl")
    listed = {f.id for f in client.files.list(purpose="batch_output")}
    assert listed == {batch.output_file_id, batch.error_file_id}
    assert [b.id for b in client.batches.list()] == [batch.id]
    with pytest.raises(openai.ConflictError, match="Cannot cancel a batch with status 'completed'"):
        client.batches.cancel(batch.id)
    # The input is no longer needed once read: it can go, the batch stays.
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    assert client.batches.retrieve(batch.id).status == "completed"

    # The server's /metrics (no key: a scraper holds none) reads the job and its shards from
    # the database, parsed with prometheus_client's own parser.
    metrics = scrape(server.port)
    assert metrics.status == 200
    assert metrics.value("conveyor_jobs", status="completed") == 1
    assert metrics.value("conveyor_jobs", status="in_progress") == 0
    assert metrics.value("conveyor_shards_waiting", model=MODEL) == 0
    assert metrics.value("conveyor_shards_in_flight", model=MODEL) == 0
    assert metrics.value("conveyor_workers_live", model=MODEL) == 1
    assert metrics.value("conveyor_metrics_database_up") == 1


def test_cancel_mid_way_keeps_the_finished_results(embedded_stack, serve, spawn_worker) -> None:
    stack = embedded_stack.with_values(engine_args=SLOW_ENGINE)
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    client = server.client(server.new_key("alice"))
    worker.wait_ready()
    n = 24
    uploaded = client.files.create(
        file=("in.jsonl", jsonl(batch_lines(n, max_tokens=160, ignore_eos=True))), purpose="batch"
    )
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")

    def some_done() -> bool:
        counts = check_api_batch(raw_batch(client, batch.id)).request_counts
        return counts is not None and counts.completed >= 2

    wait_for(some_done, 120, "a few requests to finish")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")  # again: nothing changes
    done = wait_batch(client, batch.id, timeout=60)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts is not None and 2 <= done.request_counts.completed < n
    assert done.output_file_id is not None
    results = [json.loads(text) for text in lines_of(client, done.output_file_id)]
    assert len(results) == done.request_counts.completed
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_a_batch_past_its_window_expires_with_what_finished(embedded_stack, serve, spawn_worker) -> None:
    stack = embedded_stack.with_values(engine_args=SLOW_ENGINE, min_completion_window_seconds=1)
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    client = server.client(server.new_key("alice"))
    worker.wait_ready()
    n = 40  # one at a time, 40 x 800 tokens: a minute's work at least, for a window of 6 s
    uploaded = client.files.create(
        file=("in.jsonl", jsonl(batch_lines(n, max_tokens=800, ignore_eos=True))), purpose="batch"
    )
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="6s")
    assert batch.completion_window == "6s" and batch.expires_at == batch.created_at + 6
    done = wait_batch(client, batch.id, timeout=90)
    assert done.status == "expired", done
    assert done.expired_at is not None and done.expired_at >= done.created_at + 6
    counts = done.request_counts
    assert counts is not None and counts.total == n and counts.completed + counts.failed == n
    assert counts.completed < n and done.error_file_id is not None
    errors = [json.loads(text) for text in lines_of(client, done.error_file_id)]
    assert len(errors) == counts.failed
    assert all(e["error"]["code"] == "batch_expired" and e["error"]["message"] == EXPIRED_MESSAGE for e in errors)
    if counts.completed:
        assert done.output_file_id is not None and len(lines_of(client, done.output_file_id)) == counts.completed
