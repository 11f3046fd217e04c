"""Jobs whose input is already in the object store (an uploaded file, a broker message's
reference): ``create_job`` records a ``validating`` job at once, idempotent on its key, and a
worker streams the input later (``ingest_job``, the ``conveyor.ingest_job`` task)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select, update

from conveyor.worker.broker.queues import enqueue_intake
from conveyor.worker.entrypoints.client import Client, JobFailed
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import run_shard
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.submission import SubmitOptions, create_job, ingest_job
from conveyor.worker.jobs.sweeper import Sweeper
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Job, Shard, now
from conveyor.worker.store.objects.base import InvalidKey
from tests.worker.helpers import assert_each_request_once, jsonl, openai_lines, parse_lines, wait_for


def test_key_of_names_only_objects_inside_the_store(store) -> None:
    inner = store.scoped("uploads")
    assert inner.key_of(inner.uri("a/b c.jsonl")) == "a/b c.jsonl"
    assert store.key_of(inner.uri("a/x.jsonl")) == "uploads/a/x.jsonl"
    root = store.uri()
    outside = [
        "file:///etc/passwd",
        "s3://some-other-bucket/x.jsonl",
        root,  # the store itself is no object
        root + "-sibling/x.jsonl",  # a prefix that only starts the same way
        root + "/../x.jsonl",
        root + "/a//b",
        inner.uri("x.jsonl").replace("uploads", "uploads/.."),
    ]
    for uri in outside:
        for where in (store, inner):
            with pytest.raises(InvalidKey):
                where.key_of(uri)


def _stored(client: Client, rows: list, key: str = "uploads/input.jsonl") -> str:
    client.store.put_bytes(key, jsonl(rows))
    return client.store.uri(key)


def test_create_then_ingest_runs_the_job_once(embedded_stack) -> None:
    client = Client(embedded_stack.settings)
    uri = _stored(client, [*openai_lines(5), b"{not json"])
    options = SubmitOptions(model=embedded_stack.model, shard_size=2)
    job, created = create_job(
        client.db, client.store, client.settings, uri, options, metadata={"team": "a"}, idempotency_key="k-1"
    )
    assert created and job["status"] == "validating" and job["metadata"] == {"team": "a"}
    again, created_again = create_job(client.db, client.store, client.settings, uri, options, idempotency_key="k-1")
    assert (again["id"], created_again) == (job["id"], False)

    sent: list[tuple[str, list[int]]] = []
    started = ingest_job(
        client.db, client.store, client.settings, job["id"], enqueue=lambda j, i: sent.append((j, list(i)))
    )
    assert started["status"] == "in_progress" and started["request_counts"]["total"] == 6
    assert sent == [(job["id"], [0, 1, 2])]
    # A redelivered intake finds the job started: no second set of shards or messages.
    ingest_job(client.db, client.store, client.settings, job["id"], enqueue=lambda j, i: sent.append((j, list(i))))
    assert len(sent) == 1
    # The stored input is read in place, not copied under the job's prefix.
    job_store = client.store.scoped(object_keys.job_prefix(job["id"]))
    assert not job_store.exists(object_keys.input_key("jsonl"))

    ctx = WorkerContext.create(embedded_stack.settings)
    for index in range(3):
        assert run_shard(ctx, job["id"], index).status == "completed"
    done = client.status(job["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
    assert [r["custom_id"] for r in parse_lines(client.results(job["id"]))] == [f"req-{i}" for i in range(5)]
    assert [e["error"]["line"] for e in parse_lines(client.results(job["id"], errors=True))] == [6]
    ctx.close()
    client.close()


def test_duplicates_at_once_make_one_job(pg_redis_s3_stack) -> None:
    client = Client(pg_redis_s3_stack.settings)
    uri = _stored(client, openai_lines(2))
    options = SubmitOptions(model=pg_redis_s3_stack.model)
    results: list[tuple[str, bool]] = []
    barrier = threading.Barrier(8)

    def submit() -> None:
        barrier.wait()
        job, created = create_job(client.db, client.store, client.settings, uri, options, idempotency_key="same")
        results.append((job["id"], created))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({job_id for job_id, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    with client.db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Job)).scalar_one() == 1
    client.close()


def test_bad_references_are_refused_with_the_reason(embedded_stack) -> None:
    client = Client(embedded_stack.settings)
    options = SubmitOptions(model=embedded_stack.model)
    with pytest.raises(ValueError, match=r"input_uri: .*not an object in this store"):
        create_job(client.db, client.store, client.settings, "file:///etc/passwd", options)
    with pytest.raises(ValueError, match="input_uri: there is no object"):
        create_job(client.db, client.store, client.settings, client.store.uri("uploads/missing.jsonl"), options)
    with pytest.raises(ValueError, match="idempotency_key"):
        create_job(client.db, client.store, client.settings, _stored(client, []), options, idempotency_key="x" * 300)
    with client.db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    client.close()


def test_an_input_gone_or_rejected_fails_the_job_with_the_reason(embedded_stack) -> None:
    client = Client(embedded_stack.settings.model_copy(update={"max_shards_per_job": 1}))
    options = SubmitOptions(model=embedded_stack.model, shard_size=1)
    gone, _ = create_job(
        client.db, client.store, client.settings, _stored(client, openai_lines(1), "u/a.jsonl"), options
    )
    client.store.delete("u/a.jsonl")
    failed = ingest_job(client.db, client.store, client.settings, gone["id"], enqueue=None)
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "input_not_found"

    big, _ = create_job(
        client.db, client.store, client.settings, _stored(client, openai_lines(3), "u/b.jsonl"), options
    )
    failed = ingest_job(client.db, client.store, client.settings, big["id"], enqueue=None)
    assert failed["status"] == "failed" and "CONVEYOR_MAX_SHARDS_PER_JOB" in failed["errors"]["data"][0]["message"]
    with client.db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Shard)).scalar_one() == 0
    client.close()


def test_a_worker_ingests_a_stored_input_from_its_intake_queue(pg_redis_s3_stack, spawn_worker) -> None:
    worker = spawn_worker(pg_redis_s3_stack)
    worker.wait_ready()
    client = Client(pg_redis_s3_stack.settings)
    n = 6
    uri = _stored(client, openai_lines(n))
    job, _ = create_job(
        client.db, client.store, client.settings, uri, SubmitOptions(model=pg_redis_s3_stack.model, shard_size=2)
    )
    enqueue_intake(client.app, job["id"], client.settings.queue_prefix)
    done = client.wait(job["id"], timeout=120, poll=0.2)
    db = create_db_engine(pg_redis_s3_stack.settings.database)
    assert_each_request_once(client, db, done, n)
    wait_for(lambda: "ingested" in worker.log(), 10, "the worker's intake log line")
    db.dispose()
    client.close()


def test_the_sweeper_sends_a_lost_intake_again_once_and_leaves_in_process_submissions_alone(embedded_stack) -> None:
    client = Client(embedded_stack.settings)
    options = SubmitOptions(model=embedded_stack.model, shard_size=2)
    lost, _ = create_job(client.db, client.store, client.settings, _stored(client, openai_lines(3)), options)
    fresh, _ = create_job(
        client.db, client.store, client.settings, _stored(client, openai_lines(2), "uploads/b.jsonl"), options
    )
    own, _ = create_job(
        client.db, client.store, client.settings, _stored(client, openai_lines(2), "uploads/c.jsonl"), options
    )
    old = now() - client.settings.intake_resend_seconds - 5
    own_copy = client.store.uri(f"{object_keys.job_prefix(own['id'])}/{object_keys.input_key('jsonl')}")
    with client.db.begin() as conn:
        conn.execute(update(Job).where(Job.id.in_([lost["id"], own["id"]])).values(updated_at=old))
        # what `conveyor submit` leaves if it dies mid-intake: its own copy, which may be partial
        conn.execute(update(Job).where(Job.id == own["id"]).values(input_uri=own_copy))

    def sweeper(sent: list[str]) -> Sweeper:
        return Sweeper(
            client.db, "some/other-model", client.settings,
            enqueue_shard=lambda j, i: None, enqueue_finalize=lambda j, r: None, queue_depth=lambda: 0,
            enqueue_intake=sent.append,
        )  # fmt: skip

    first: list[str] = []
    second: list[str] = []
    assert sweeper(first).sweep_once().intakes == [lost["id"]]  # any model's worker may re-send it
    assert first == [lost["id"]]
    assert sweeper(second).sweep_once().intakes == [] and second == []  # claimed: the clock starts again
    with client.db.connect() as conn:
        status = conn.execute(select(Job.status).where(Job.id == fresh["id"])).scalar_one()
    assert status == "validating"
    client.close()


def test_a_worker_recovers_a_job_whose_intake_message_was_lost(embedded_stack, spawn_worker) -> None:
    stack = embedded_stack.with_values(intake_resend_seconds=2.0)
    worker = spawn_worker(stack)
    worker.wait_ready()
    client = Client(stack.settings)
    n = 4
    job, _ = create_job(
        client.db, client.store, client.settings, _stored(client, openai_lines(n)),
        SubmitOptions(model=stack.model, shard_size=2),
    )  # fmt: skip
    # no enqueue_intake: as if the broker lost the message
    done = client.wait(job["id"], timeout=120, poll=0.2)
    db = create_db_engine(stack.settings.database)
    assert_each_request_once(client, db, done, n)
    assert "1 intakes sent again" in worker.log()
    db.dispose()
    client.close()


def test_following_a_job_still_in_intake_waits_for_its_shards(embedded_stack) -> None:
    """``results --follow`` right after a batch is created through the API or the broker, while a
    worker has yet to take its input in: the follower waits for the shards (it once ended at
    once with nothing, exit 0); an intake that fails the job makes it raise with the reason."""
    client = Client(embedded_stack.settings)
    options = SubmitOptions(model=embedded_stack.model, shard_size=2)
    job, _ = create_job(client.db, client.store, client.settings, _stored(client, openai_lines(5)), options)
    followed: list[bytes] = []
    reader = threading.Thread(target=lambda: followed.extend(client.result_bytes(job["id"], follow=True, poll=0.05)))
    reader.start()
    reader.join(1.0)
    assert reader.is_alive() and not followed, "the follower ended before the job's input was taken in"
    ingest_job(client.db, client.store, client.settings, job["id"], enqueue=None)
    ctx = WorkerContext.create(embedded_stack.settings)
    for index in range(3):
        assert run_shard(ctx, job["id"], index).status == "completed"
    reader.join(30)
    assert not reader.is_alive()
    assert [r["custom_id"] for r in parse_lines(line.decode() for line in followed)] == [f"req-{i}" for i in range(5)]

    doomed, _ = create_job(
        client.db, client.store, client.settings, _stored(client, openai_lines(1), "u/gone.jsonl"), options
    )
    client.store.delete("u/gone.jsonl")
    failures: list[Exception] = []

    def follow_doomed() -> None:
        try:
            list(client.result_bytes(doomed["id"], follow=True, poll=0.05))
        except JobFailed as exc:
            failures.append(exc)

    doomed_reader = threading.Thread(target=follow_doomed)
    doomed_reader.start()
    ingest_job(client.db, client.store, client.settings, doomed["id"], enqueue=None)  # fails: input_not_found
    doomed_reader.join(30)
    assert not doomed_reader.is_alive() and len(failures) == 1 and doomed["id"] in str(failures[0])
    ctx.close()
    client.close()
