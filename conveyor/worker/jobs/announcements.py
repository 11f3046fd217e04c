"""Announcing a job's end on the broker: the database side of an outbox.

A job that names a reply target (``Job.notify``: the ``reply_to`` of a broker-level
submission) is announced once it ends (``completed``, ``failed``, ``cancelled`` or
``expired``, however it got there): one JSON message, its body ``announcement_body``, is
published to that target and then ``notified_at`` is set. Publishing is the broker layer's
(``conveyor.worker.broker.announce``); this module says which announcements are due and claims
them, so that two workers rarely publish the same one.

A claim is a compare-and-set on the job's ``updated_at`` (a finished job no longer changes
it) and holds for a lease period:

- whoever ended the job in a worker claims its announcement at once (``claim``), publishes
  it, then marks it sent (``mark_announced``);
- every worker's periodic pass (``claim_due``) takes, oldest first, the announcements due
  whose job has not changed for a lease period: their announcer died or could not publish
  (a failed publish keeps its claim, so it is tried again a lease period later, behind the
  others), or none ran (a job cancelled from the CLI ends in a process that has no broker
  connection).

``notified_at`` is set after the publish succeeded, so delivery is at least once: a crash
between the two publishes the announcement again, with the same message id, which
consumers dedupe on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.models import Job, JobStatus, now

BATCH = 64
TERMINAL = tuple(s for s in JobStatus if s.terminal)
EVENT_PREFIX = "batch."  # the event of a job that ended `completed` is "batch.completed"


def announcement_body(job: Job) -> dict[str, Any]:
    """What is published when ``job`` (finished) is announced: its batch object, with the
    submission's idempotency key beside it (a consumer matches it to what it sent)."""
    batch = job.as_batch_object()
    return {
        "event": EVENT_PREFIX + batch["status"],
        "job_id": job.id,
        "status": batch["status"],
        "idempotency_key": job.idempotency_key,
        "batch": batch,
    }


def message_id(job_id: str, status: str) -> str:
    """The announcement's message id: one per job and final status (a job taken up again
    by ``conveyor retry`` ends a second time and is announced again)."""
    return f"{job_id}:{status}"


@dataclass(frozen=True)
class Claim:
    """An announcement this process may publish now."""

    job_id: str
    target: dict[str, Any]  # the job's ``notify``
    body: dict[str, Any]
    previous: float  # the job's ``updated_at`` before the claim
    claimed: float  # and the value the claim set

    @property
    def message_id(self) -> str:
        return message_id(self.job_id, self.body["status"])

    @property
    def idempotency_key(self) -> str | None:
        key = self.body.get("idempotency_key")
        return key if isinstance(key, str) else None


def _due():
    return (Job.notify.is_not(None), Job.notified_at.is_(None), Job.status.in_(TERMINAL))


def _take(session: Session, job: Job, t: float) -> Claim | None:
    """Claim ``job``'s announcement if nothing changed it since it was read."""
    won = (
        session.connection()
        .execute(
            update(Job)
            .where(Job.id == job.id, Job.updated_at == job.updated_at, Job.notified_at.is_(None))
            .values(updated_at=t)
            .execution_options(synchronize_session=False)
        )
        .rowcount
    )
    if not won or not isinstance(job.notify, dict):
        return None
    return Claim(job.id, dict(job.notify), announcement_body(job), job.updated_at, t)


def claim(db: Engine, job_id: str) -> Claim | None:
    """Claim ``job_id``'s announcement now, if it is due (the job ended, names a target and
    was not announced yet). For whoever just ended the job; None otherwise."""
    with make_sessionmaker(db).begin() as session:
        job = session.scalars(select(Job).where(Job.id == job_id, *_due())).one_or_none()
        return None if job is None else _take(session, job, now())


def claim_due(db: Engine, *, lease_seconds: float, limit: int = BATCH) -> list[Claim]:
    """Claim up to ``limit`` due announcements whose job has not changed for ``lease_seconds``
    (oldest first): those whose announcer died, failed, or never ran."""
    t = now()
    claims = []
    with make_sessionmaker(db).begin() as session:
        jobs = session.scalars(
            select(Job).where(*_due(), Job.updated_at < t - lease_seconds).order_by(Job.updated_at).limit(limit)
        ).all()
        for job in jobs:
            taken = _take(session, job, t)
            if taken is not None:
                claims.append(taken)
    return claims


def mark_announced(db: Engine, claim: Claim) -> bool:
    """Record that ``claim``'s announcement was published (False: someone else did first)."""
    with db.begin() as conn:
        return bool(
            conn.execute(
                update(Job)
                .where(Job.id == claim.job_id, Job.notified_at.is_(None))
                .values(notified_at=now())
                .execution_options(synchronize_session=False)
            ).rowcount
        )
