"""A job after submission: its batch object, its status, and cancelling it.

Statuses: ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed``; a cancel moves
a live job to ``cancelling`` and, once its running shards have stopped, ``cancelled``. A job
past its completion window takes the same path to ``expired`` (``conveyor.worker.jobs.expiry``).
Submission is ``conveyor.worker.jobs.submission``, finalisation ``conveyor.worker.jobs.finalize``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.engine import Engine

from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.finalize import finalize_if_ready, finalize_job
from conveyor.worker.jobs.progress import live_batch_object
from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.models import Job, JobStatus, Shard, ShardStatus, now
from conveyor.worker.store.objects.base import ObjectStore


class JobNotFound(LookupError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "job not found"


def get_job(db: Engine, job_id: str, *, refresh: bool = False) -> dict[str, Any]:
    """The batch object; ``refresh`` shows a live job's request counts, usage so far and
    ``progress`` counted from its items (``conveyor.worker.jobs.progress``: one read over them; the
    stored counts are written as shards finish, not by a status call)."""
    object_keys.check_job_id(job_id)
    with make_sessionmaker(db)() as session:
        job = session.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id}")
        return live_batch_object(db, job) if refresh else job.as_batch_object()


MAX_LIST_LIMIT = 1000


def list_jobs(
    db: Engine, *, statuses: Sequence[JobStatus] = (), limit: int = 20, after: str | None = None
) -> list[dict[str, Any]]:
    """Batch objects, newest first: at most ``limit``, only ``statuses`` if given, and only
    those created before job ``after`` (a cursor, as OpenAI's list endpoints take)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r}")
    stmt = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    if statuses:
        stmt = stmt.where(Job.status.in_([JobStatus(s) for s in statuses]))
    with make_sessionmaker(db)() as session:
        if after is not None:
            object_keys.check_job_id(after)
            cursor = session.get(Job, after)
            if cursor is None:
                raise JobNotFound(f"no job {after}")
            stmt = stmt.where(
                or_(Job.created_at < cursor.created_at, and_(Job.created_at == cursor.created_at, Job.id < cursor.id))
            )
        return [job.as_batch_object() for job in session.scalars(stmt)]


def cancel_job(db: Engine, store: ObjectStore, job_id: str, *, heartbeat_seconds: float = 10.0) -> dict[str, Any]:
    """Stop a job: no new shard starts, running shards withdraw the items the engine has not
    started within ``cancel_poll_seconds`` (those it runs finish and are kept), results so far
    are kept and every request not run becomes a ``batch_cancelled`` error. Idempotent; a
    finished job is left as is. The batch object shows the counts so far while it is
    ``cancelling``."""
    request_cancel(db, job_id)
    finish_cancel(db, store, job_id, heartbeat_seconds=heartbeat_seconds)
    return get_job(db, job_id, refresh=True)


def request_cancel(db: Engine, job_id: str) -> None:
    """The quick half of a cancel: the job becomes ``cancelling`` and its pending shards
    ``cancelled`` (running ones see it and stop). ``finish_cancel`` writes the files; if the
    caller never gets to it, a worker's sweeper does (``conveyor.worker.jobs.sweeper``)."""
    object_keys.check_job_id(job_id)
    t = now()
    with db.begin() as conn:
        found = conn.execute(select(Job.status).where(Job.id == job_id)).scalar_one_or_none()
        if found is None:
            raise JobNotFound(f"no job {job_id}")
        conn.execute(
            update(Job)
            .where(Job.id == job_id, Job.status.in_((JobStatus.validating, JobStatus.in_progress)))
            .values(status=JobStatus.cancelling, cancelling_at=t, updated_at=t)
        )
        conn.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == ShardStatus.pending)
            .values(status=ShardStatus.cancelled, finished_at=t)
        )


def finish_cancel(db: Engine, store: ObjectStore, job_id: str, *, heartbeat_seconds: float = 10.0) -> None:
    """The slow half: once no shard runs, finalise the job (its results and errors files,
    ``cancelled``); a finalisation that stalled is redone."""
    if finalize_if_ready(db, store, job_id, heartbeat_seconds=heartbeat_seconds) is None:
        _refinalize_if_stalled(db, store, job_id, heartbeat_seconds)


def _refinalize_if_stalled(db: Engine, store: ObjectStore, job_id: str, heartbeat_seconds: float) -> None:
    """A cancelled job whose finaliser died (claimed long ago, no heartbeat): redo it here."""
    with db.connect() as conn:
        row = conn.execute(select(Job.status, Job.finalizing_at, Job.updated_at).where(Job.id == job_id)).one()
    stale = row.finalizing_at is not None and now() - row.updated_at > 6 * heartbeat_seconds
    if JobStatus(row.status) is JobStatus.cancelling and stale:
        finalize_job(db, store, job_id, heartbeat_seconds=heartbeat_seconds)


class NotRetryable(ValueError):
    """A job that ``retry`` cannot take up again (the message says why)."""


def reopen_unenqueued(db: Engine, job_id: str) -> list[int]:
    """Take up a job whose shards could not be enqueued (``failed`` with ``enqueue_failed``):
    its input stays where it was stored; it goes back to ``in_progress`` and its never-started
    shards to ``pending``. Returns their indices, to enqueue; ``NotRetryable`` otherwise."""
    object_keys.check_job_id(job_id)
    t = now()
    with db.begin() as conn:
        row = conn.execute(select(Job.status, Job.errors).where(Job.id == job_id)).one_or_none()
        if row is None:
            raise JobNotFound(f"no job {job_id}")
        codes = [e.get("code") for e in row.errors or []]
        if JobStatus(row.status) is not JobStatus.failed or codes != ["enqueue_failed"]:
            why = f"it failed: {row.errors[0].get('message')}" if row.errors else f"it is {JobStatus(row.status).value}"
            raise NotRetryable(
                f"job {job_id} cannot be retried: {why} (only a job whose shards could not be enqueued can be)"
            )
        reopened = conn.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.failed)
            # notified_at: its failure may have been announced; its end will be, again
            .values(status=JobStatus.in_progress, failed_at=None, errors=None, notified_at=None, updated_at=t)
        ).rowcount
        if not reopened:  # another retry got here first
            raise NotRetryable(f"job {job_id} is being retried already")
        shards = conn.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == ShardStatus.cancelled, Shard.attempts == 0)
            .values(status=ShardStatus.pending, finished_at=None, heartbeat_at=t)
            .returning(Shard.shard_index)
        ).scalars()
        return sorted(shards)


def job_model(db: Engine, job_id: str) -> str:
    """The model a job runs on (its queue's): ``JobNotFound`` if there is no such job."""
    with db.connect() as conn:
        model = conn.execute(select(Job.model).where(Job.id == job_id)).scalar_one_or_none()
    if model is None:
        raise JobNotFound(f"no job {job_id}")
    return model
