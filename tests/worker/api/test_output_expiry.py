"""A batch's output files expire (``output_expires_after``, else the deployment's 30-day
default), through the official ``openai`` SDK against a worker process, PostgreSQL and S3
(moto): the file objects show ``expires_at``; once it passes, the API's sweep deletes the
stored object and the row, a download is a 404 saying the file expired, and ``/metrics``
counts the files and bytes. A Message Batch's results go after Anthropic's 29 days (the
``anthropic`` SDK). Time is moved by setting ``expires_at`` or ``created_at`` in the database:
the public bounds (an hour at least) stay as they are."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import openai
import pytest
from sqlalchemy import func, select, update

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.jobs.message_batches import job_id_of
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Item, Job, StoredFile
from conveyor.worker.store.objects.base import ObjectNotFound
from conveyor.worker.store.objects.factory import open_store_from_settings
from tests.worker.api.test_message_batches import wait_ended
from tests.worker.api_batches import CHAT, MODEL, batch_lines, wait_batch
from tests.worker.api_server import upload
from tests.worker.helpers import scrape, wait_for

HOUR, THIRTY_DAYS = 3600, 2_592_000


def test_output_files_expire_and_the_sweep_deletes_them(pg_redis_s3_stack, serve, spawn_worker) -> None:
    stack = pg_redis_s3_stack.with_values(expired_files_interval_seconds=0.2)
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    client = server.client(server.new_key("alice"))
    worker.wait_ready()

    rows = [*batch_lines(2), b"{not json"]  # two results and one error line
    kept_hour = client.batches.create(
        input_file_id=upload(client, rows),
        endpoint=CHAT,
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": HOUR},
    )
    default = client.batches.create(
        input_file_id=upload(client, batch_lines(1)), endpoint=CHAT, completion_window="24h"
    )
    kept_hour, default = wait_batch(client, kept_hour.id), wait_batch(client, default.id)
    assert kept_hour.status == default.status == "completed"
    assert kept_hour.output_file_id and kept_hour.error_file_id and default.output_file_id
    output, errors = client.files.retrieve(kept_hour.output_file_id), client.files.retrieve(kept_hour.error_file_id)
    # OpenAI's anchor is the file's creation: each file lives that long from when it was written.
    assert output.expires_at == output.created_at + HOUR and errors.expires_at == errors.created_at + HOUR
    other = client.files.retrieve(default.output_file_id)
    assert other.expires_at == other.created_at + THIRTY_DAYS
    assert [f.expires_at for f in client.files.list(purpose="batch_output") if f.id == output.id] == [output.expires_at]
    input_file = client.files.retrieve(kept_hour.input_file_id)
    assert input_file.expires_at is None  # an upload expires only when asked to

    db = create_db_engine(stack.settings.database)
    store = open_store_from_settings(stack.settings)
    try:
        with db.connect() as conn:
            uris = dict(conn.execute(select(StoredFile.id, StoredFile.uri)).all())
        keys = {file_id: store.key_of(uris[file_id]) for file_id in (output.id, errors.id, other.id)}
        assert all(store.exists(key) for key in keys.values())
        assert keys[output.id] == f"jobs/{kept_hour.id}/results.jsonl"

        # The hour passes.
        past = time.time() - 1
        with db.begin() as conn:
            conn.execute(update(StoredFile).where(StoredFile.id.in_([output.id, errors.id])).values(expires_at=past))

        def swept() -> bool:
            with db.connect() as conn:
                left = conn.execute(select(StoredFile.id).where(StoredFile.id.in_([output.id, errors.id]))).all()
            return not left

        wait_for(swept, 30, "the API's sweep to delete the expired files")
        assert not store.exists(keys[output.id]) and not store.exists(keys[errors.id])
        assert store.exists(keys[other.id])  # the other batch's file is not due
        # The answers the files were made of go with them; the other batch keeps its own.
        with db.connect() as conn:
            items = dict(conn.execute(select(Item.job_id, func.count()).group_by(Item.job_id)).all())
        assert items == {default.id: 1}
    finally:
        db.dispose()
    # conveyor results (the Client) says so too, rather than rebuilding them or answering nothing.
    with Client(stack.settings) as cli, pytest.raises(ObjectNotFound, match=f"job {kept_hour.id} expired at"):
        list(cli.result_bytes(kept_hour.id))

    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(past))
    for read in (client.files.retrieve, client.files.content):
        with pytest.raises(openai.NotFoundError) as caught:
            read(output.id)
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["message"] == f"File {output.id} expired at {stamp} (its expires_at) and was deleted."
    assert {f.id for f in client.files.list(purpose="batch_output")} == {other.id}
    assert client.files.content(other.id).text.count("\n") == 1
    # The batch still names its files, as OpenAI's does.
    assert client.batches.retrieve(kept_hour.id).output_file_id == output.id

    metrics = scrape(server.port)
    assert metrics.value("conveyor_files_expired_total") == 2
    assert metrics.value("conveyor_files_expired_bytes_total") == output.bytes + errors.bytes


def test_message_batch_results_are_archived_after_29_days(pg_redis_s3_stack, serve, spawn_worker) -> None:
    stack = pg_redis_s3_stack.with_values(expired_files_interval_seconds=0.2)
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    client = anthropic.Anthropic(base_url=server.url, api_key=server.new_key("alice"), max_retries=0, timeout=60.0)
    worker.wait_ready()
    requests: Any = [
        {
            "custom_id": f"r{i}",
            "params": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(2)
    ]
    batches = [client.messages.batches.create(requests=requests) for _ in range(2)]
    old, young = (wait_ended(client, b.id) for b in batches)
    assert old.archived_at is None and len(list(client.messages.batches.results(old.id))) == 2
    job_id = job_id_of(old.id)

    db = create_db_engine(stack.settings.database)
    store = open_store_from_settings(stack.settings).scoped(f"jobs/{job_id}")
    try:
        assert store.exists("results.jsonl") and store.exists("custom_ids.txt")
        sizes = sum(store.size(key) for key in ("results.jsonl", "errors.jsonl", "custom_ids.txt"))
        created = time.time() - 29 * 86_400 - 1  # Anthropic's 29 days pass for one of them
        with db.begin() as conn:
            conn.execute(update(Job).where(Job.id == job_id).values(created_at=created))

        def archived() -> bool:
            with db.connect() as conn:
                return conn.execute(select(Job.output_uri).where(Job.id == job_id)).scalar_one() is None

        wait_for(archived, 30, "the API's sweep to archive the batch's results")

        def left() -> list[str]:
            return [key for key in ("results.jsonl", "errors.jsonl", "custom_ids.txt") if store.exists(key)]

        # The sweep forgets the row first, then deletes the objects: wait for both.
        wait_for(lambda: not left(), 30, "the API's sweep to delete the batch's results")
        assert left() == []
        with db.connect() as conn:
            items = dict(conn.execute(select(Item.job_id, func.count()).group_by(Item.job_id)).all())
        assert items == {job_id_of(young.id): 2}
    finally:
        db.dispose()
    shown = client.messages.batches.retrieve(old.id)
    assert shown.archived_at is not None and int(shown.archived_at.timestamp()) == int(created + 29 * 86_400)
    with pytest.raises(anthropic.NotFoundError) as caught:
        list(client.messages.batches.results(old.id))
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["message"].startswith(f"The results of message batch {old.id} were archived at")
    assert client.messages.batches.retrieve(young.id).archived_at is None
    assert len(list(client.messages.batches.results(young.id))) == 2

    metrics = scrape(server.port)
    assert metrics.value("conveyor_message_batches_archived_total") == 1
    assert metrics.value("conveyor_message_batches_archived_bytes_total") == sizes
