"""Message Batches as jobs, without a worker: the inline requests stored and taken in by the
same intake, then ended by expiry or a cancel; each request's result is then read from the
job's files and its stored input (``expired``, ``canceled``, ``errored``), the counts add up,
and a deleted batch leaves neither rows nor objects. On embedded defaults and on PostgreSQL + S3."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import update

from conveyor.worker.batchio.anthropic_batch_body import iter_batch_requests
from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.expiry import expire_if_due
from conveyor.worker.jobs.lifecycle import JobNotFound, finish_cancel
from conveyor.worker.jobs.message_batch_input import INPUT, store_requests
from conveyor.worker.jobs.message_batches import (
    cancel_message_batch,
    current_job,
    delete_message_batch,
    job_id_of,
    load_job,
    message_batch_id,
    message_batch_object,
)
from conveyor.worker.jobs.message_results import iter_results
from conveyor.worker.jobs.owned_jobs import fail_unqueued
from conveyor.worker.jobs.quotas import Charge
from conveyor.worker.jobs.submission import SubmitOptions, create_job, ingest_job
from conveyor.worker.store.models import Job, now

OWNER = "key-1"
BASE = "http://api.test/v1/messages/batches"


@pytest.fixture(params=["embedded", "pg_redis_s3"])
def client(request: pytest.FixtureRequest) -> Client:
    stack = request.getfixturevalue("embedded_stack" if request.param == "embedded" else "pg_redis_s3_stack")
    return Client(stack.settings)


def _requests(model: str) -> list[dict[str, Any]]:
    def params(**extra: Any) -> dict[str, Any]:
        return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra}

    return [
        {"custom_id": "a", "params": params()},
        {"custom_id": "bad", "params": params(top_logprobs=2)},
        {"custom_id": "b", "params": params(system="brief")},
    ]


def _create(client: Client, *, ingest: bool) -> str:
    job_id = object_keys.new_job_id()
    job_store = client.store.scoped(object_keys.job_prefix(job_id))
    body = json.dumps({"requests": _requests("tiny-chat")})
    scan = store_requests(job_store, iter_batch_requests(body, 100))
    options = SubmitOptions(
        model=scan.models[0], completion_window="24h", request_options=RequestOptions(endpoint=MESSAGES)
    )
    charge = Charge.of_scan(scan, client.settings.default_max_tokens)
    create_job(
        client.db, client.store, client.settings, job_store.uri(INPUT), options, owner=OWNER, job_id=job_id,
        charge=charge,
    )  # fmt: skip
    if ingest:
        ingest_job(client.db, client.store, client.settings, job_id, enqueue=None)
    return message_batch_id(job_id)


def _results(client: Client, batch_id: str) -> dict[str, dict[str, Any]]:
    job = current_job(client.db, client.store, batch_id, OWNER, 1.0)
    lines = [json.loads(line) for line in iter_results(client.store, job)]
    assert len({line["custom_id"] for line in lines}) == len(lines)
    return {line["custom_id"]: line["result"] for line in lines}


def test_an_expired_batch_reports_each_request_that_never_ran(client: Client) -> None:
    batch_id = _create(client, ingest=True)
    job_id = job_id_of(batch_id)
    assert job_id.removeprefix("batch_") == batch_id.removeprefix("msgbatch_")
    running = message_batch_object(client.db, load_job(client.db, batch_id, OWNER), BASE)
    assert running["processing_status"] == "in_progress" and running["results_url"] is None
    assert running["request_counts"] == {"processing": 2, "succeeded": 0, "errored": 1, "canceled": 0, "expired": 0}

    with client.db.begin() as conn:
        conn.execute(update(Job).where(Job.id == job_id).values(expires_at=now() - 1))
    assert expire_if_due(client.db, client.store, job_id, heartbeat_seconds=1.0)
    ended = message_batch_object(client.db, current_job(client.db, client.store, batch_id, OWNER, 1.0), BASE)
    assert ended["processing_status"] == "ended" and ended["ended_at"] is not None
    assert ended["results_url"] == f"{BASE}/{batch_id}/results"
    assert ended["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 1, "canceled": 0, "expired": 2}
    results = _results(client, batch_id)
    assert results["a"] == results["b"] == {"type": "expired"}
    assert results["bad"]["type"] == "errored" and results["bad"]["error"]["error"]["type"] == "invalid_request_error"
    assert "top_logprobs" in results["bad"]["error"]["error"]["message"]


def test_a_batch_cancelled_before_its_intake_reports_every_request_canceled(client: Client) -> None:
    batch_id = _create(client, ingest=False)
    cancelling = cancel_message_batch(client.db, batch_id, OWNER)
    assert message_batch_object(client.db, cancelling, BASE)["cancel_initiated_at"] is not None
    ingest_job(client.db, client.store, client.settings, cancelling.id, enqueue=None)  # the intake comes late
    finish_cancel(client.db, client.store, cancelling.id, heartbeat_seconds=1.0)
    ended = message_batch_object(client.db, load_job(client.db, batch_id, OWNER), BASE)
    assert ended["processing_status"] == "ended"
    assert ended["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 3, "expired": 0}
    assert _results(client, batch_id) == {name: {"type": "canceled"} for name in ("a", "bad", "b")}


def test_a_batch_that_failed_as_a_whole_reports_each_request_errored_with_the_reason(client: Client) -> None:
    batch_id = _create(client, ingest=False)
    fail_unqueued(client.db, job_id_of(batch_id), "the batch could not be handed to the workers: OperationalError")
    ended = message_batch_object(client.db, load_job(client.db, batch_id, OWNER), BASE)
    assert ended["processing_status"] == "ended"
    assert ended["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 3, "canceled": 0, "expired": 0}
    results = _results(client, batch_id)
    assert sorted(results) == ["a", "b", "bad"]
    for result in results.values():
        assert result["type"] == "errored" and result["error"]["error"]["type"] == "api_error"
        assert result["error"]["error"]["message"] == "the batch could not be handed to the workers: OperationalError"


def test_a_deleted_batch_leaves_no_rows_nor_objects_and_is_anothers_to_nobody(client: Client) -> None:
    batch_id = _create(client, ingest=True)
    job_store = client.store.scoped(object_keys.job_prefix(job_id_of(batch_id)))
    with pytest.raises(JobNotFound):
        load_job(client.db, batch_id, "another-key")
    with pytest.raises(JobNotFound):
        delete_message_batch(client.db, client.store, batch_id, "another-key")
    with client.db.begin() as conn:
        conn.execute(update(Job).where(Job.id == job_id_of(batch_id)).values(expires_at=now() - 1))
    assert expire_if_due(client.db, client.store, job_id_of(batch_id), heartbeat_seconds=1.0)
    assert list(job_store.list())  # what an ended job keeps: its custom_ids (and output files)
    assert delete_message_batch(client.db, client.store, batch_id, OWNER) == {
        "id": batch_id, "type": "message_batch_deleted",
    }  # fmt: skip
    assert list(job_store.list()) == []
    with pytest.raises(JobNotFound):
        load_job(client.db, batch_id, OWNER)
    with pytest.raises(JobNotFound):
        job_id_of(job_id_of(batch_id))  # an OpenAI batch id is no message batch id
