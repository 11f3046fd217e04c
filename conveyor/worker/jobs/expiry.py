"""Jobs past their completion window become ``expired`` (OpenAI's status), whoever notices.

A job still ``validating`` or ``in_progress`` at ``expires_at`` is stopped like a cancel: it
goes to ``cancelling`` with ``expired_at`` set, its pending shards are cancelled, running
shards see the status within ``cancel_poll_seconds`` and stop, keeping what finished. The
finaliser then records every request not finished as a ``batch_expired`` error and ends the
job ``expired`` (``conveyor.worker.jobs.finalize``).

Workers check on a background thread (``expire_due_jobs``, every model's jobs: a job whose
model nobody serves must expire too), and so do ``status``, ``wait`` and ``results --follow``
(``expire_if_due``), so a job expires on time even with no worker running at all. Every step
is a compare-and-set, so any number of checkers act once.
"""

from __future__ import annotations

import logging

from sqlalchemy import and_, or_, select, update
from sqlalchemy.engine import Engine

from conveyor.worker.jobs.finalize import finalize_if_ready, finalize_job
from conveyor.worker.store.models import Job, JobStatus, Shard, ShardStatus, now
from conveyor.worker.store.objects.base import ObjectStore

log = logging.getLogger(__name__)

BATCH = 64
_NOT_STARTED_OR_RUNNING = (JobStatus.validating, JobStatus.in_progress)


def expire_if_due(db: Engine, store: ObjectStore, job_id: str, *, heartbeat_seconds: float = 10.0) -> bool:
    """Expire ``job_id`` if its window has passed (and carry on an expiry under way: cancel
    shards whose worker died, finalise once none runs). True if this call expired it."""
    t = now()
    with db.begin() as conn:
        won = conn.execute(
            update(Job)
            .where(
                Job.id == job_id,
                Job.status.in_(_NOT_STARTED_OR_RUNNING),
                Job.expires_at.is_not(None),
                Job.expires_at <= t,
            )
            .values(status=JobStatus.cancelling, expired_at=t, updated_at=t)
            .execution_options(synchronize_session=False)
        ).rowcount
        row = conn.execute(select(Job.status, Job.expired_at, Job.finalizing_at).where(Job.id == job_id)).one_or_none()
    if row is None or row.expired_at is None or JobStatus(row.status) is not JobStatus.cancelling:
        return False
    if won:
        log.warning("job %s passed its completion window: expiring it", job_id)
    _stop_shards(db, job_id)
    if finalize_if_ready(db, store, job_id, heartbeat_seconds=heartbeat_seconds) is None:
        _refinalize_if_stalled(db, store, job_id, heartbeat_seconds)
    return bool(won)


def expire_due_jobs(db: Engine, store: ObjectStore, *, heartbeat_seconds: float = 10.0) -> list[str]:
    """Expire (or carry on expiring) up to ``BATCH`` jobs of any model; the ids this call expired."""
    t = now()
    due = and_(Job.status.in_(_NOT_STARTED_OR_RUNNING), Job.expires_at <= t)
    winding_down = and_(Job.status == JobStatus.cancelling, Job.expired_at.is_not(None))
    with db.connect() as conn:
        ids = list(conn.execute(select(Job.id).where(or_(due, winding_down)).limit(BATCH)).scalars())
    return [job_id for job_id in ids if expire_if_due(db, store, job_id, heartbeat_seconds=heartbeat_seconds)]


def _stop_shards(db: Engine, job_id: str) -> None:
    """No pending shard starts; a running one whose lease ran out (its worker is gone, and
    maybe no worker serves the model any more) is cancelled rather than waited for."""
    t = now()
    with db.begin() as conn:
        conn.execute(
            update(Shard)
            .where(
                Shard.job_id == job_id,
                or_(
                    Shard.status == ShardStatus.pending,
                    and_(Shard.status == ShardStatus.running, Shard.lease_expires_at < t),
                ),
            )
            .values(status=ShardStatus.cancelled, lease_owner=None, lease_expires_at=None, finished_at=t)
            .execution_options(synchronize_session=False)
        )


def _refinalize_if_stalled(db: Engine, store: ObjectStore, job_id: str, heartbeat_seconds: float) -> None:
    """An expiring job whose finaliser died (claimed long ago, no heartbeat since): redo it."""
    with db.connect() as conn:
        row = conn.execute(select(Job.finalizing_at, Job.updated_at).where(Job.id == job_id)).one()
    if row.finalizing_at is not None and now() - row.updated_at > 6 * heartbeat_seconds:
        finalize_job(db, store, job_id, heartbeat_seconds=heartbeat_seconds)
