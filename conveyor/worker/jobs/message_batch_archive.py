"""A Message Batch's results after Anthropic's 29 days: archived.

Anthropic keeps an ended batch's results for 29 days from its creation; after that the batch
is still shown, with ``archived_at``, but its results are gone. Here the API server's sweep
deletes an ended Message Batch's results and errors files, its list of custom_ids and its items
``CONVEYOR_MESSAGE_BATCH_RESULTS_EXPIRE_AFTER_SECONDS`` after it was created, and clears the
job's ``output_uri`` and ``error_uri``; the batch object then shows ``archived_at`` and its
results are a 404 that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, or_, select, update
from sqlalchemy.engine import Engine

from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.message_batch_input import CUSTOM_IDS
from conveyor.worker.store.models import Item, Job, JobStatus, now
from conveyor.worker.store.objects.base import ObjectStore

_ENDED = (JobStatus.completed, JobStatus.failed, JobStatus.expired, JobStatus.cancelled)


@dataclass(frozen=True)
class ArchivedBatches:
    """What one pass of ``archive_due`` deleted."""

    batches: int = 0
    bytes: int = 0


def archived_at(created_at: float, keep_seconds: int, t: float | None = None) -> float | None:
    """When a Message Batch created at ``created_at`` is archived, if it is by ``t`` (now)."""
    if not keep_seconds:
        return None
    due = created_at + keep_seconds
    return due if due <= (now() if t is None else t) else None


def archive_due(db: Engine, store: ObjectStore, keep_seconds: int, *, limit: int = 100) -> ArchivedBatches:
    """Delete the results of up to ``limit`` ended Message Batches created ``keep_seconds`` ago
    or earlier (0: never); only their own objects, under ``jobs/<id>/``."""
    if not keep_seconds:
        return ArchivedBatches()
    with db.connect() as conn:
        ids = list(
            conn.execute(
                select(Job.id)
                .where(
                    Job.endpoint == MESSAGES,
                    Job.status.in_(_ENDED),
                    Job.created_at <= now() - keep_seconds,
                    or_(Job.output_uri.is_not(None), Job.error_uri.is_not(None)),
                )
                .limit(limit)
            ).scalars()
        )
    batches = nbytes = 0
    for job_id in ids:
        with db.begin() as conn:
            done = conn.execute(
                update(Job)
                .where(Job.id == job_id, or_(Job.output_uri.is_not(None), Job.error_uri.is_not(None)))
                .values(output_uri=None, error_uri=None)
                .execution_options(synchronize_session=False)
            ).rowcount
            if not done:  # another server archived it
                continue
            conn.execute(delete(Item).where(Item.job_id == job_id))
        job_store = store.scoped(object_keys.job_prefix(job_id))
        for key in (object_keys.RESULTS, object_keys.ERRORS, CUSTOM_IDS):
            if job_store.exists(key):
                nbytes += job_store.size(key)
                job_store.delete(key)
        batches += 1
    return ArchivedBatches(batches, nbytes)
