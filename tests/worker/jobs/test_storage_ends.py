"""Storage that ends, on PostgreSQL and S3 (moto), through the API with the ``openai`` SDK:
a batch's working objects go when it ends, the files it keeps count against its owner until
deleted, and the storage sweep removes what crashes left behind.

The worker's part (intake, shards) runs in this process, as the worker's tasks run it."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from typing import Any, Final

import openai
import pytest
from sqlalchemy import select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import run_shard
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.lifecycle import NotRetryable
from conveyor.worker.jobs.quotas import StoredUsage, stored_usage
from conveyor.worker.jobs.storage_sweep import StorageSweeper
from conveyor.worker.jobs.submission import SubmitError, SubmitOptions, ingest_job, submit_job
from conveyor.worker.store.models import Job
from tests.worker.helpers import jsonl, openai_lines, wait_for

CHAT: Final = "/v1/chat/completions"
MODEL = "tiny-chat"


@pytest.fixture
def tenant(pg_redis_s3_stack, serve):
    stack = pg_redis_s3_stack.with_values(models=[MODEL], served_model_name=MODEL, shard_size=100)
    server = serve(stack)
    client = Client(stack.settings)
    yield stack, client, server.client(server.new_key("tenant"))
    client.close()


def _rows(count: int, **body: Any) -> bytes:
    rows: list[Any] = openai_lines(count, max_tokens=2)
    for row in rows:
        row["body"]["model"] = MODEL
        row["body"].update(body)
    return jsonl([*rows, b"{not json"])  # one line rejected at validation: the errors file holds it


def _create(api: openai.OpenAI, data: bytes) -> tuple[str, str]:
    file_id = api.files.create(file=("in.jsonl", data), purpose="batch").id
    return file_id, api.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id


def _unfinished(api: openai.OpenAI, batch_id: str) -> tuple[int, list[bytes]]:
    """``GET /v1/batches/{id}/unfinished`` (beyond the SDK): its status and lines."""
    url = f"{str(api.base_url).rstrip('/')}/batches/{batch_id}/unfinished"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api.api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().splitlines()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().splitlines()


def _folder(client: Client, batch_id: str) -> list[str]:
    folder = f"{object_keys.job_prefix(batch_id)}/"
    return [key.removeprefix(folder) for key in client.store.list(folder)]


def _usage(client: Client, batch_id: str) -> StoredUsage:
    with client.db.connect() as conn:
        owner = conn.execute(select(Job.owner).where(Job.id == batch_id)).scalar_one()
        return stored_usage(conn, owner)


def _wait(api: openai.OpenAI, batch_id: str, status: str) -> Any:
    deadline = time.monotonic() + 60
    while (batch := api.batches.retrieve(batch_id)).status != status:
        assert time.monotonic() < deadline, f"batch {batch_id} is {batch.status}, never {status}"
        time.sleep(0.1)
    return batch


def test_upload_create_cancel_delete_leaves_nothing_and_the_quota_returns_to_zero(tenant) -> None:
    stack, client, api = tenant
    data = _rows(250)
    file_id, batch_id = _create(api, data)
    ingest_job(client.db, client.store, stack.settings, batch_id, enqueue=lambda _job, _shards: None)
    assert api.batches.retrieve(batch_id).status == "in_progress"
    assert [k for k in _folder(client, batch_id) if k.startswith("shards/")] == [
        object_keys.shard_input_key(i) for i in range(3)
    ]
    assert _usage(client, batch_id) == StoredUsage(files=1, bytes=len(data))

    api.batches.cancel(batch_id)
    batch = _wait(api, batch_id, "cancelled")
    # No request ran: no results file; the errors file (the rejected line) is kept and counted.
    assert batch.output_file_id is None and batch.error_file_id is not None
    # The working objects go just after the final state is recorded (the cancel's finaliser).
    wait_for(lambda: _folder(client, batch_id) == [object_keys.ERRORS], 10, "the working objects to go")
    errors_bytes = api.files.retrieve(batch.error_file_id).bytes
    assert errors_bytes > 0 and _usage(client, batch_id) == StoredUsage(files=2, bytes=len(data) + errors_bytes)
    # The lines to resubmit come from the input file, as uploaded: no copy is stored uncounted.
    assert _unfinished(api, batch_id) == (200, data.splitlines()[:-1])  # all but the line refused at validation

    api.files.delete(file_id)
    status, body = _unfinished(api, batch_id)
    assert status == 404 and f"input file {file_id} was deleted".encode() in b"".join(body)
    api.files.delete(batch.error_file_id)
    assert _folder(client, batch_id) == []
    assert list(client.store.list("files/")) == []
    assert _usage(client, batch_id) == StoredUsage(files=0, bytes=0)


def test_a_completed_batch_keeps_only_its_files_and_they_count_until_deleted(tenant) -> None:
    stack, client, api = tenant
    data = _rows(4)
    file_id, batch_id = _create(api, data)
    ingest_job(client.db, client.store, stack.settings, batch_id, enqueue=lambda _job, _shards: None)
    ctx = WorkerContext.create(stack.settings, model=stack.model)
    try:
        assert run_shard(ctx, batch_id, 0).status == "completed"
    finally:
        ctx.close()
    batch = _wait(api, batch_id, "completed")
    assert batch.request_counts is not None and batch.request_counts.completed == 4
    assert _folder(client, batch_id) == [object_keys.ERRORS, object_keys.RESULTS]
    kept = [file_id, batch.output_file_id, batch.error_file_id]
    sizes = [api.files.retrieve(f).bytes for f in kept if f is not None]
    assert len(sizes) == 3 and _usage(client, batch_id) == StoredUsage(files=3, bytes=sum(sizes))
    assert [line["custom_id"] for line in map(json.loads, api.files.content(kept[1]).text.splitlines())] == [
        f"req-{i}" for i in range(4)
    ]
    for f in kept:
        api.files.delete(f)
    assert _folder(client, batch_id) == [] and _usage(client, batch_id) == StoredUsage(files=0, bytes=0)


def _sweep(sweeper: StorageSweeper, passes: int = 40) -> tuple[set[str], set[str]]:
    """Enough passes of a small page to walk the whole store more than once."""
    working: set[str] = set()
    orphans: set[str] = set()
    for _ in range(passes):
        report = sweeper.sweep_once()
        working.update(report.working)
        orphans.update(report.orphans)
    return working, orphans


def test_the_storage_sweep_removes_what_crashes_left_and_nothing_else(pg_redis_s3_stack) -> None:
    stack = pg_redis_s3_stack
    client = Client(stack.settings)
    store = client.store
    rows = jsonl(openai_lines(3, max_tokens=2))
    # An intake that crashed: objects under a job id that no job row has.
    orphan = object_keys.new_job_id()
    store.put_bytes(f"jobs/{orphan}/input.jsonl", rows)
    store.put_bytes(f"jobs/{orphan}/shards/000000.jsonl", b"{}\n")
    # A job that ended, whose finaliser died before it deleted the shards and parts.
    ended = client.submit(rows, stack.model, shard_size=1, enqueue=False)["id"]
    assert client.cancel(ended)["status"] == "cancelled"
    ended_keys = [object_keys.ERRORS, object_keys.RESULTS, object_keys.unfinished_key("jsonl")]
    assert _folder(client, ended) == ended_keys  # (its input copy goes: the unrun lines stay to resubmit)
    for key in (object_keys.shard_input_key(0), object_keys.part_results_key(0), object_keys.INVALID):
        store.put_bytes(f"jobs/{ended}/{key}", b"left behind\n")
    # A live job, and one whose shards could not be enqueued (``conveyor retry`` runs them).
    live = client.submit(rows, stack.model, shard_size=1, enqueue=False)["id"]
    live_keys = _folder(client, live)
    with pytest.raises(SubmitError, match="enqueue"):
        submit_job(client.db, store, stack.settings, io.BytesIO(rows), SubmitOptions(model=stack.model, shard_size=1),
                   enqueue=_broker_down)  # fmt: skip
    (unqueued,) = [j["id"] for j in client.jobs(status=["failed"])]
    unqueued_keys = _folder(client, unqueued)
    assert "shards/000000.jsonl" in unqueued_keys
    store.put_bytes("jobs/notes/readme.txt", b"not a job's")  # not a job id: never touched

    working, orphans = _sweep(StorageSweeper(client.db, store, grace_seconds=3600, page=3))
    assert (working, orphans) == ({ended}, set())
    assert _folder(client, ended) == ended_keys
    assert _folder(client, live) == live_keys and _folder(client, unqueued) == unqueued_keys
    assert len(_folder(client, orphan)) == 2  # younger than the grace period: maybe a job being made

    time.sleep(1.2)  # (S3 keeps times to the second)
    working, orphans = _sweep(StorageSweeper(client.db, store, grace_seconds=0.1, page=3))
    assert (working, orphans) == ({unqueued}, {orphan})
    assert _folder(client, orphan) == [] and _folder(client, unqueued) == []
    assert _folder(client, live) == live_keys and _folder(client, ended) == ended_keys
    assert store.exists("jobs/notes/readme.txt")
    with pytest.raises(NotRetryable, match="CONVEYOR_STORAGE_GRACE_SECONDS"):
        client.retry(unqueued)
    client.close()


def _broker_down(_job_id: str, _shards: Any) -> None:
    raise ConnectionError("the broker is down")


def test_following_a_job_that_ends_meanwhile_reads_the_rest_from_its_files(embedded_stack) -> None:
    """The follower's lines come from the working objects until the job ends and they go; then
    from the errors file, whole: no line rejected at validation is lost."""
    client = Client(embedded_stack.settings)
    rows = jsonl([*openai_lines(3, max_tokens=2), b"{not json"])
    job = client.submit(rows, embedded_stack.model, shard_size=2, enqueue=False)
    errors = client.result_bytes(job["id"], errors=True, follow=True)  # lazy: nothing read yet
    results = client.result_bytes(job["id"], follow=True)
    ctx = WorkerContext.create(embedded_stack.settings)
    try:
        for index in range(job["num_shards"]):
            assert run_shard(ctx, job["id"], index).status == "completed"
    finally:
        ctx.close()
    assert client.status(job["id"])["status"] == "completed"
    assert not any(client.store.list(f"{object_keys.job_prefix(job['id'])}/shards/"))
    (rejected,) = [json.loads(line) for line in errors]
    assert rejected["error"]["code"] == "invalid_json" and rejected["error"]["line"] == 4
    assert [json.loads(line)["custom_id"] for line in results] == ["req-0", "req-1", "req-2"]
    client.close()
