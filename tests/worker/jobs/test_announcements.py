"""The announcements outbox: which jobs are due, claims that keep two publishers apart, and
the publisher (a publish that fails gives its claim back; one that succeeds is recorded)."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kombu import Connection, Queue
from sqlalchemy import select

from conveyor.worker.broker.announce import Announcer
from conveyor.worker.broker.config import celery_app
from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.announcements import claim, claim_due, mark_announced
from conveyor.worker.jobs.lifecycle import reopen_unenqueued
from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.models import Job, JobStatus, now

TARGET = {"queue": "replies"}


def add_job(db, status: JobStatus, *, notify: dict | None = TARGET, age: float = 0.0, **values: Any) -> str:
    job_id = object_keys.new_job_id()
    t = now() - age
    with make_sessionmaker(db).begin() as session:
        session.add(
            Job(
                id=job_id, status=status, model="m", shard_size=4, notify=notify, idempotency_key=f"key-{job_id}",
                meta={"team": "a"}, created_at=t, updated_at=t, **values,
            )
        )  # fmt: skip
    return job_id


def notified_at(db, job_id: str) -> float | None:
    with db.connect() as conn:
        return conn.execute(select(Job.notified_at).where(Job.id == job_id)).scalar_one()


def test_only_a_finished_job_with_a_target_not_yet_announced_is_claimed(db_engine) -> None:
    done = add_job(db_engine, JobStatus.completed, total_requests=3, completed_requests=3)
    no_target = add_job(db_engine, JobStatus.completed, notify=None)
    running = add_job(db_engine, JobStatus.in_progress)
    announced = add_job(db_engine, JobStatus.failed, notified_at=now())
    assert [claim(db_engine, j) for j in (no_target, running, announced)] == [None, None, None]
    taken = claim(db_engine, done)
    assert taken is not None and taken.target == TARGET
    assert taken.message_id == f"{done}:completed" and taken.idempotency_key == f"key-{done}"
    body = taken.body
    assert body["event"] == "batch.completed" and body["job_id"] == done and body["status"] == "completed"
    assert body["batch"]["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert body["batch"]["metadata"] == {"team": "a"}
    assert claim_due(db_engine, lease_seconds=60) == []  # just claimed: its claimer is publishing
    assert mark_announced(db_engine, taken) and not mark_announced(db_engine, taken)
    assert notified_at(db_engine, done) is not None
    assert claim(db_engine, done) is None and claim_due(db_engine, lease_seconds=0) == []


@pytest.mark.parametrize("status", [JobStatus.completed, JobStatus.failed, JobStatus.cancelled, JobStatus.expired])
def test_the_periodic_pass_takes_every_end_once_a_lease_has_passed(db_engine, status: JobStatus) -> None:
    stale = add_job(db_engine, status, age=100)
    add_job(db_engine, status)  # ended just now: whoever ended it announces it
    taken = claim_due(db_engine, lease_seconds=60)
    assert [c.job_id for c in taken] == [stale]
    assert taken[0].body["event"] == f"batch.{status.value}"
    assert claim_due(db_engine, lease_seconds=60) == []  # claimed: nobody else takes it for a lease
    again = claim_due(db_engine, lease_seconds=0)  # a lease later, unpublished: taken again
    assert stale in [c.job_id for c in again]


def test_workers_claiming_at_once_take_each_announcement_once(db_engine) -> None:
    if db_engine.dialect.name == "sqlite":
        pytest.skip("one writer at a time: SQLite serialises the claims anyway")
    jobs = {add_job(db_engine, JobStatus.completed, age=100) for _ in range(24)}
    start = threading.Barrier(4)

    def sweep() -> list[str]:
        start.wait()
        return [c.job_id for c in claim_due(db_engine, lease_seconds=60, limit=24)]

    with ThreadPoolExecutor(4) as pool:
        claimed = [job_id for taken in pool.map(lambda _: sweep(), range(4)) for job_id in taken]
    assert sorted(claimed) == sorted(jobs)  # every one, by one claimer only


def test_a_retried_job_is_announced_again_when_it_ends_again(db_engine) -> None:
    job_id = add_job(
        db_engine, JobStatus.failed, notified_at=now(),
        errors=[{"code": "enqueue_failed", "message": "broker down", "param": None, "line": None}],
    )  # fmt: skip
    reopen_unenqueued(db_engine, job_id)
    assert notified_at(db_engine, job_id) is None


def test_a_failed_publish_is_tried_again_a_lease_later(db_engine, tmp_path) -> None:
    job_id = add_job(db_engine, JobStatus.completed, age=100)
    settings = Settings(home=tmp_path, broker_url="redis://127.0.0.1:1/0")  # nothing listens there
    announcer = Announcer(celery_app(settings, "q"), db_engine, settings)
    assert announcer.announce(job_id) is False
    assert notified_at(db_engine, job_id) is None
    assert claim_due(db_engine, lease_seconds=60) == []  # tried again a lease period later,
    assert [c.job_id for c in claim_due(db_engine, lease_seconds=0)] == [job_id]  # not lost


def test_an_announcement_is_a_plain_json_message_published_once(db_engine, redis_broker, tmp_path) -> None:
    queue = f"replies-{uuid.uuid4().hex[:8]}"
    job_id = add_job(db_engine, JobStatus.cancelled, notify={"queue": queue}, age=100)
    settings = Settings(home=tmp_path, **redis_broker)
    announcer = Announcer(celery_app(settings, "q"), db_engine, settings)
    assert announcer.announce(job_id) is True
    assert announcer.announce(job_id) is False and announcer.announce_due() == 0
    assert notified_at(db_engine, job_id) is not None
    options = redis_broker["broker_transport_options"]
    with Connection(redis_broker["broker_url"], transport_options=options) as conn:
        simple = conn.SimpleQueue(Queue(queue))
        message = simple.get(timeout=5)
        assert message.content_type == "application/json"
        assert message.properties["message_id"] == f"{job_id}:cancelled"
        assert message.payload["event"] == "batch.cancelled" and message.payload["job_id"] == job_id
        message.ack()
        with pytest.raises(simple.Empty):
            simple.get(timeout=0.5)
        simple.close()
