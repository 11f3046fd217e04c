"""Jobs as one owner sees them (the HTTP API's batches): each call is scoped to the owner
(an API key's id, or ``None``), and another owner's job is "not found", never "forbidden".

Reads stay reads: a live job's request counts are counted from its items for the answer,
not stored (``refresh_job_counts`` writes); a job past its window is expired first, as
``conveyor status`` does, but only when it is due (the check costs no write otherwise).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.engine import Engine

from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.expiry import expire_if_due
from conveyor.worker.jobs.lifecycle import JobNotFound, request_cancel
from conveyor.worker.jobs.progress import live_batch_object
from conveyor.worker.jobs.webhook_events import record_job_end
from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.models import Job, JobStatus, now
from conveyor.worker.store.objects.base import ObjectStore

MAX_LIST_LIMIT = 100  # OpenAI's, for batches
_LIVE = (JobStatus.validating, JobStatus.in_progress)


class NotCancellable(RuntimeError):
    """A batch that already ended (completed, failed or expired)."""


def _owned_by(owner: str | None):
    return Job.owner == owner if owner is not None else Job.owner.is_(None)


def _load(db: Engine, job_id: str, owner: str | None) -> Job:
    if not object_keys.is_job_id(job_id):
        raise JobNotFound(f"No batch found with id '{job_id!s:.80}'.")
    with make_sessionmaker(db)() as session:
        job = session.scalars(select(Job).where(Job.id == job_id, _owned_by(owner))).one_or_none()
    if job is None:
        raise JobNotFound(f"No batch found with id '{job_id}'.")
    return job


def _due(job: Job) -> bool:
    status = JobStatus(job.status)
    passed = job.expires_at is not None and job.expires_at <= now()
    return (status in _LIVE and passed) or (status is JobStatus.cancelling and job.expired_at is not None)


def _view(db: Engine, job: Job) -> dict[str, Any]:
    return live_batch_object(db, job)  # a live job's counts and usage so far


def owned_batch(
    db: Engine, store: ObjectStore, job_id: str, owner: str | None, *, heartbeat_seconds: float = 10.0
) -> dict[str, Any]:
    """``owner``'s job as a batch object; ``JobNotFound`` if it has none of that id."""
    job = _load(db, job_id, owner)
    if _due(job):
        expire_if_due(db, store, job_id, heartbeat_seconds=heartbeat_seconds)
        job = _load(db, job_id, owner)
    return _view(db, job)


def list_owned_batches(db: Engine, owner: str | None, *, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    """OpenAI's list page of ``owner``'s batches, newest first, those created before ``after``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r:.40}")
    stmt = select(Job).where(_owned_by(owner))
    if after is not None:
        cursor = _load(db, after, owner)
        stmt = stmt.where(
            or_(Job.created_at < cursor.created_at, and_(Job.created_at == cursor.created_at, Job.id < cursor.id))
        )
    with make_sessionmaker(db)() as session:
        jobs = list(session.scalars(stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)))
    data = [_view(db, job) for job in jobs[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(jobs) > limit,
    }


def cancel_owned_batch(db: Engine, job_id: str, owner: str | None) -> dict[str, Any]:
    """Start cancelling ``owner``'s job (results so far kept; ``finish_cancel`` writes its
    files, and a worker's sweeper does if nobody does). Cancelling a cancelled (or cancelling)
    job changes nothing; ``NotCancellable`` for one that completed, failed or expired."""
    job = _load(db, job_id, owner)
    status = JobStatus(job.status)
    expiring = status is JobStatus.cancelling and job.expired_at is not None  # ends `expired`
    if status in (JobStatus.completed, JobStatus.failed, JobStatus.expired) or expiring:
        raise NotCancellable(f"Cannot cancel a batch with status '{'expired' if expiring else status.value}'.")
    if status not in (JobStatus.cancelling, JobStatus.cancelled):
        request_cancel(db, job_id)
    return _view(db, _load(db, job_id, owner))


def fail_unqueued(db: Engine, job_id: str, message: str) -> None:
    """A ``create_job`` job whose intake could not be enqueued (the broker was down): it ends
    ``failed`` (``enqueue_failed``) rather than wait forever for a worker to read its input."""
    t = now()
    with db.begin() as conn:
        failed = conn.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.validating)
            .values(
                status=JobStatus.failed,
                failed_at=t,
                updated_at=t,
                errors=[{"code": "enqueue_failed", "message": message, "param": None, "line": None}],
            )
        ).rowcount
        if failed:
            record_job_end(conn, job_id, JobStatus.failed, t)
