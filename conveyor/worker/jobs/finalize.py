"""Finishing a job: once every shard is done, one results file and one errors file.

``claim_finalization`` is the compare-and-set that picks one finaliser (whoever finished
the last shard, or the canceller); ``finalize_job`` writes both files as streamed
(multipart) uploads, stores the aggregate metrics and sets the final status. It is
idempotent: a finaliser that died half-way is replaced by another (the sweeper notices a
``finalizing`` job whose ``updated_at`` heartbeat went stale), which rewrites the same bytes.
Only once the job's end is committed are its working objects (shards, parts) deleted
(``working_objects``): a finaliser that dies before leaves them for the next one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import exists, select, update
from sqlalchemy.engine import Engine

from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.files import OutputFile, record_output_files
from conveyor.worker.jobs.output_files import ShardSource, copy_lines, iter_job_output
from conveyor.worker.jobs.unfinished import write_unfinished
from conveyor.worker.jobs.unrun_items import CANCELLED, EXPIRED, record_unrun_items
from conveyor.worker.jobs.webhook_events import record_job_end
from conveyor.worker.jobs.working_objects import discard_working_objects
from conveyor.worker.store.items import refresh_job_counts, summarize_job
from conveyor.worker.store.models import Job, JobStatus, Shard, ShardStatus, now
from conveyor.worker.store.objects.base import ObjectStore

log = logging.getLogger(__name__)

ACTIVE_SHARD = (ShardStatus.pending, ShardStatus.running)


@dataclass(frozen=True)
class FinalizeResult:
    job_id: str
    status: JobStatus
    results: int
    errors: int


def _no_active_shards(job_id: str):
    return ~exists().where(Shard.job_id == job_id, Shard.status.in_(ACTIVE_SHARD))


def claim_finalization(db: Engine, job_id: str) -> bool:
    """True if this caller won the right to finalise: the job is ``in_progress`` (becomes
    ``finalizing``) or ``cancelling`` (stays so), nobody claimed it yet, and no shard is
    pending or running."""
    with db.begin() as conn:
        status = conn.execute(select(Job.status).where(Job.id == job_id)).scalar_one_or_none()
        if status is None or JobStatus(status) not in (JobStatus.in_progress, JobStatus.cancelling):
            return False
        new = JobStatus.finalizing if JobStatus(status) is JobStatus.in_progress else JobStatus.cancelling
        t = now()
        stmt = (
            update(Job)
            .where(Job.id == job_id, Job.status == status, Job.finalizing_at.is_(None), _no_active_shards(job_id))
            .values(status=new, finalizing_at=t, updated_at=t)
            .execution_options(synchronize_session=False)
        )
        return conn.execute(stmt).rowcount == 1


class _Heartbeat:
    """Touches the job's ``updated_at`` at most every ``every`` seconds while files are written.

    Called for each line copied rather than from a ``Periodic`` thread, on purpose: it beats
    only while the copy makes progress, so a finaliser stuck on a hung upload goes stale and
    the sweeper hands the job to another."""

    def __init__(self, db: Engine, job_id: str, every: float) -> None:
        self.db, self.job_id, self.every = db, job_id, every
        self._last = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self._last < self.every:
            return
        self._last = time.monotonic()
        with self.db.begin() as conn:
            conn.execute(update(Job).where(Job.id == self.job_id).values(updated_at=now()))


def job_shards(db: Engine, job_id: str) -> list[tuple[int, bool]]:
    """``(shard index, part files written)`` for every shard, in order."""
    with db.connect() as conn:
        rows = conn.execute(
            select(Shard.shard_index, Shard.output_uri).where(Shard.job_id == job_id).order_by(Shard.shard_index)
        )
        return [(index, uri is not None) for index, uri in rows]


def finalize_job(
    db: Engine, root_store: ObjectStore, job_id: str, *, heartbeat_seconds: float = 10.0
) -> FinalizeResult | None:
    """Write the job's results and errors files and set its final status. Call after
    winning ``claim_finalization`` (or to redo a stalled one); None if the job is not
    being finalised."""
    with db.connect() as conn:
        job = conn.execute(
            select(
                Job.status, Job.finalizing_at, Job.expired_at, Job.owner, Job.input_file_id, Job.request_options
            ).where(Job.id == job_id)
        ).one_or_none()
    if (
        job is None
        or job.finalizing_at is None
        or JobStatus(job.status) not in (JobStatus.finalizing, JobStatus.cancelling)
    ):
        return None
    final = _final_status(JobStatus(job.status), expired=job.expired_at is not None)
    job_store = root_store.scoped(object_keys.job_prefix(job_id))
    if final is not JobStatus.completed:  # every request not finished is reported, as OpenAI does
        record_unrun_items(db, root_store, job_id, EXPIRED if final is JobStatus.expired else CANCELLED)
        if job.owner is None:  # an owner's are read from its input file when asked: nothing uncounted is kept
            write_unfinished(db, root_store, job_id)
    refresh_job_counts(db, job_id)
    summarize_job(db, job_id)
    source = ShardSource.of_job(db, job_store, job_id)
    shards = job_shards(db, job_id)
    beat = _Heartbeat(db, job_id, heartbeat_seconds)
    with job_store.open_write(object_keys.RESULTS) as out:
        n_results = copy_lines(iter_job_output(source, shards, errors=False), out.write, beat)
    results = OutputFile(job_store.uri(object_keys.RESULTS), out.bytes_written, n_results)
    with job_store.open_write(object_keys.ERRORS) as out:
        n_errors = copy_lines(iter_job_output(source, shards, errors=True), out.write, beat)
    errors = OutputFile(job_store.uri(object_keys.ERRORS), out.bytes_written, n_errors)
    # A batch of the HTTP API keeps an output file only if it holds lines (it is a Files
    # object, counted against its owner's stored bytes); conveyor submit's jobs keep both.
    counts = ((object_keys.RESULTS, n_results), (object_keys.ERRORS, n_errors))
    empty = [key for key, n in counts if not n] if job.input_file_id is not None else []
    t = now()
    values: dict[str, object] = {
        "status": final,
        "output_uri": None if object_keys.RESULTS in empty else results.uri,
        "error_uri": None if object_keys.ERRORS in empty else errors.uri,
        "updated_at": t,
    }
    if final is not JobStatus.expired:  # (an expired job's expired_at is when it expired)
        values["completed_at" if final is JobStatus.completed else "cancelled_at"] = t
    with db.begin() as conn:
        done = conn.execute(
            update(Job)
            .where(Job.id == job_id, Job.status.in_((JobStatus.finalizing, JobStatus.cancelling)))
            .values(**values)
            .execution_options(synchronize_session=False)
        ).rowcount
        if done:
            record_job_end(conn, job_id, final, t)
        if done and job.input_file_id is not None:  # a batch of the HTTP API: its files are Files objects
            keep = RequestOptions.from_json(job.request_options).output_expires_after
            record_output_files(conn, job_id, job.owner, results, errors, expires_after=keep)
    if done:
        log.info("job %s %s: %d results, %d errors", job_id, final.value, n_results, n_errors)
    # Ended now (by this call or another): what the files were built from can go.
    discard_working_objects(root_store, job_id, also=empty)
    return FinalizeResult(job_id, final, n_results, n_errors)


def _final_status(status: JobStatus, *, expired: bool) -> JobStatus:
    """``finalizing`` ends ``completed``; ``cancelling`` ends ``expired`` when the job passed its
    window (``conveyor.worker.jobs.expiry`` stops it like a cancel), else ``cancelled``."""
    if status is JobStatus.finalizing:
        return JobStatus.completed
    return JobStatus.expired if expired else JobStatus.cancelled


def finalize_if_ready(
    db: Engine, root_store: ObjectStore, job_id: str, *, heartbeat_seconds: float = 10.0
) -> FinalizeResult | None:
    """Claim and run the finalisation if every shard is done; None otherwise."""
    if not claim_finalization(db, job_id):
        return None
    return finalize_job(db, root_store, job_id, heartbeat_seconds=heartbeat_seconds)
