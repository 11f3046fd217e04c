"""Jobs as Anthropic Message Batches: ids, the ``message_batch`` object, list, cancel, delete.

A Message Batch is a job whose endpoint is ``/v1/messages``: its id is the job's with
``msgbatch_`` for ``batch_`` (the same 32 hex digits both ways), and it belongs to the API key
that created it; any other key, and a job of another door, is "not found".

``processing_status`` is ``in_progress`` while the job is validating, running or finalising,
``canceling`` while a cancel stops it, and ``ended`` once it completed, failed, expired or was
cancelled. ``request_counts`` are live while it runs (Anthropic's stay at zero until the end):
``processing`` the requests not finished yet, ``succeeded`` and ``errored`` those finished; at
the end, those a cancel left are ``canceled`` and those the window left ``expired``.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import and_, delete, or_, select
from sqlalchemy.engine import Engine

from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.batchio.output_lines import BATCH_CANCELLED, BATCH_EXPIRED
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.expiry import expire_if_due
from conveyor.worker.jobs.lifecycle import JobNotFound, request_cancel
from conveyor.worker.jobs.message_batch_archive import archived_at
from conveyor.worker.jobs.progress import live_batch_object
from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.models import Item, ItemStatus, Job, JobStatus, now
from conveyor.worker.store.objects.base import ObjectStore

PREFIX = "msgbatch_"
_ID = re.compile(r"msgbatch_([0-9a-f]{32})")
MAX_LIST_LIMIT = 1000  # Anthropic's
ENDED = (JobStatus.completed, JobStatus.failed, JobStatus.expired, JobStatus.cancelled)
_LIVE = (JobStatus.validating, JobStatus.in_progress)


class NotEnded(RuntimeError):
    """A batch that has not ended yet (it cannot be deleted, nor its results read)."""


def message_batch_id(job_id: str) -> str:
    return PREFIX + object_keys.check_job_id(job_id).removeprefix("batch_")


def job_id_of(batch_id: str) -> str:
    """The job id of a Message Batch id; ``JobNotFound`` if it is not one."""
    match = _ID.fullmatch(batch_id) if isinstance(batch_id, str) else None
    if match is None:
        raise JobNotFound(f"No message batch found with id '{batch_id!s:.80}'.")
    return f"batch_{match.group(1)}"


def _mine(owner: str | None):
    return and_(Job.owner == owner if owner is not None else Job.owner.is_(None), Job.endpoint == MESSAGES)


def load_job(db: Engine, batch_id: str, owner: str | None) -> Job:
    """``owner``'s Message Batch's job; ``JobNotFound`` if it has none of that id."""
    job_id = job_id_of(batch_id)
    with make_sessionmaker(db)() as session:
        job = session.scalars(select(Job).where(Job.id == job_id, _mine(owner))).one_or_none()
    if job is None:
        raise JobNotFound(f"No message batch found with id '{batch_id}'.")
    return job


def current_job(db: Engine, store: ObjectStore, batch_id: str, owner: str | None, heartbeat_seconds: float) -> Job:
    """As ``load_job``, expired first if its window passed (as ``owned_batch`` does)."""
    job = load_job(db, batch_id, owner)
    status = JobStatus(job.status)
    due = status in _LIVE and job.expires_at is not None and job.expires_at <= now()
    if due or (status is JobStatus.cancelling and job.expired_at is not None):
        expire_if_due(db, store, job.id, heartbeat_seconds=heartbeat_seconds)
        job = load_job(db, batch_id, owner)
    return job


def rfc3339(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def processing_status(job: Job) -> str:
    status = JobStatus(job.status)
    if status in ENDED:
        return "ended"
    return "canceling" if status is JobStatus.cancelling else "in_progress"


def ended_at(job: Job) -> float | None:
    status = JobStatus(job.status)
    if status not in ENDED:
        return None
    return job.completed_at or job.cancelled_at or job.failed_at or job.updated_at


def message_batch_object(db: Engine, job: Job, results_base: str, *, keep_results: int = 0) -> dict[str, Any]:
    """The ``message_batch`` object of ``job``; ``results_base`` is the URL that the batch's
    id and ``/results`` follow (``https://host/v1/messages/batches``). ``keep_results``: the
    seconds after its creation its results are kept (``message_batch_archive``; 0: always)."""
    batch_id = message_batch_id(job.id)
    ended = processing_status(job) == "ended"
    archived = archived_at(job.created_at, keep_results) if ended else None
    return {
        "id": batch_id,
        "type": "message_batch",
        "processing_status": processing_status(job),
        "request_counts": request_counts(db, job),
        "created_at": rfc3339(job.created_at),
        "ended_at": rfc3339(ended_at(job)),
        "expires_at": rfc3339(job.expires_at),
        "cancel_initiated_at": rfc3339(job.cancelling_at),
        "archived_at": rfc3339(archived),
        "results_url": f"{results_base}/{batch_id}/results" if ended else None,
    }


def request_counts(db: Engine, job: Job) -> dict[str, int]:
    counts = live_batch_object(db, job)["request_counts"]
    # Until its intake has counted them, a job's requests are those it was charged for.
    total = counts["total"] or job.charged_lines or 0
    succeeded, errored = counts["completed"] or 0, counts["failed"] or 0
    out = {"processing": 0, "succeeded": succeeded, "errored": errored, "canceled": 0, "expired": 0}
    left = max(0, total - succeeded - errored)
    status = JobStatus(job.status)
    if status in (JobStatus.cancelled, JobStatus.expired):
        kind = "canceled" if status is JobStatus.cancelled else "expired"
        unrun = unrun_items(db, job.id, BATCH_CANCELLED if status is JobStatus.cancelled else BATCH_EXPIRED)
        out[kind], out["errored"] = unrun + left, max(0, errored - unrun)
    elif status is JobStatus.failed:
        out["errored"] += left
    else:
        out["processing"] = left
    return out


def unrun_items(db: Engine, job_id: str, code: str) -> int:
    """The requests of a job that its cancel or window left unrun (stored as items with ``code``)."""
    stmt = select(Item.error).where(Item.job_id == job_id, Item.status == ItemStatus.failed)
    with db.connect() as conn:
        rows = conn.execution_options(yield_per=1000).execute(stmt)
        return sum(1 for (error,) in rows if (error or {}).get("code") == code)


def list_message_batches(
    db: Engine, owner: str | None, *, limit: int = 20, before_id: str | None = None, after_id: str | None = None
) -> tuple[list[Job], bool]:
    """``owner``'s Message Batches newest first: at most ``limit`` of those just older than
    ``after_id``, or just newer than ``before_id``; and whether there are more that way."""
    stmt = select(Job).where(_mine(owner))
    newer = before_id is not None
    cursor_id = before_id if before_id is not None else after_id
    if cursor_id is not None:
        cursor = load_job(db, cursor_id, owner)
        same = and_(Job.created_at == cursor.created_at, Job.id > cursor.id if newer else Job.id < cursor.id)
        beyond = Job.created_at > cursor.created_at if newer else Job.created_at < cursor.created_at
        stmt = stmt.where(or_(beyond, same))
    order = (Job.created_at.asc(), Job.id.asc()) if newer else (Job.created_at.desc(), Job.id.desc())
    with make_sessionmaker(db)() as session:
        jobs = list(session.scalars(stmt.order_by(*order).limit(limit + 1)))
    page = jobs[:limit]
    return (page[::-1] if newer else page), len(jobs) > limit


def cancel_message_batch(db: Engine, batch_id: str, owner: str | None) -> Job:
    """Start cancelling the batch (an ended or canceling one is left as it is)."""
    job = load_job(db, batch_id, owner)
    if JobStatus(job.status) in _LIVE:
        request_cancel(db, job.id)
    return load_job(db, batch_id, owner)


def delete_message_batch(db: Engine, store: ObjectStore, batch_id: str, owner: str | None) -> dict[str, Any]:
    """Delete an ended batch: its job, items and objects (``NotEnded`` otherwise)."""
    job = load_job(db, batch_id, owner)
    if JobStatus(job.status) not in ENDED:
        raise NotEnded(
            f"Message batch {batch_id} cannot be deleted while it is {processing_status(job)}; cancel it first, "
            "then delete it once it has ended."
        )
    with db.begin() as conn:  # its items, shards and crash records go with it (ON DELETE CASCADE)
        conn.execute(delete(Job).where(Job.id == job.id))
    job_store = store.scoped(object_keys.job_prefix(job.id))
    for key in list(job_store.list()):
        job_store.delete(key)
    return {"id": batch_id, "type": "message_batch_deleted"}
