"""The job lifecycle: submit, status, cancel (finalisation is in ``worker.finalize``).

``submit_job`` validates the input into object storage (``worker.intake``), creates the
job and its shards, and hands the shard indices to ``enqueue`` (one Celery task each; the
in-process ``conveyor run`` passes none and runs the shards itself). A job whose input is
rejected as a whole ends ``failed`` with the reason in ``errors``.

Statuses: ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed``; a cancel
moves a live job to ``cancelling`` and, once its running shards have stopped, ``cancelled``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine

from worker import keys
from worker.finalize import finalize_if_ready, finalize_job
from worker.formats import InputError, InputFormat
from worker.intake import ingest
from worker.queues import canonical_model
from worker.settings import Settings
from worker.store.db import Job, JobStatus, Shard, ShardStatus, make_sessionmaker, now
from worker.store.items import refresh_job_counts
from worker.store.objects import ObjectStore

log = logging.getLogger(__name__)

Enqueue = Callable[[str, Sequence[int]], None]


class JobNotFound(LookupError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "job not found"


class SubmitError(RuntimeError):
    """The job was created but could not be handed to the broker."""


@dataclass(frozen=True)
class SubmitOptions:
    model: str
    shard_size: int | None = None
    priority: int = 0
    input_format: InputFormat = InputFormat.jsonl


def check_options(settings: Settings, options: SubmitOptions) -> tuple[str, int, int]:
    """(canonical model, shard size, priority), or ``ValueError`` naming the bad value."""
    model = canonical_model(options.model)
    shard_size = settings.shard_size if options.shard_size is None else options.shard_size
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or not 1 <= shard_size <= settings.max_shard_size:
        raise ValueError(f"shard size must be an integer from 1 to {settings.max_shard_size} (CONVEYOR_MAX_SHARD_SIZE), got {shard_size!r}")
    priority = options.priority
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= settings.max_priority:
        raise ValueError(f"priority must be an integer from 0 to {settings.max_priority} (CONVEYOR_MAX_PRIORITY), got {priority!r}")
    return model, shard_size, priority


def submit_job(
    db: Engine,
    store: ObjectStore,
    settings: Settings,
    source: BinaryIO,
    options: SubmitOptions,
    *,
    enqueue: Enqueue | None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Validate, store and shard the input, create the job; returns the batch object."""
    model, shard_size, priority = check_options(settings, options)
    job_id = keys.new_job_id()
    job_store = store.scoped(keys.job_prefix(job_id))
    fmt = InputFormat(options.input_format)
    sessions = make_sessionmaker(db)
    with sessions.begin() as session:
        session.add(
            Job(
                id=job_id, status=JobStatus.validating, model=model, priority=priority,
                input_format=fmt.value, shard_size=shard_size, meta=metadata,
                input_uri=job_store.uri(keys.input_key(fmt.value)),
            )
        )  # fmt: skip
    try:
        intake = ingest(
            source, job_store, job_id, limits=settings.input_limits(), input_format=fmt,
            shard_size=shard_size, max_shards=settings.max_shards_per_job,
        )  # fmt: skip
    except InputError as exc:
        _fail(db, job_id, "invalid_input", str(exc))
        return get_job(db, job_id)
    except BaseException as exc:
        _fail(db, job_id, "submit_failed", f"the input could not be stored: {type(exc).__name__}")
        raise
    t = now()
    with db.begin() as conn:
        if intake.shards:
            conn.execute(
                insert(Shard),
                [
                    {
                        "job_id": job_id, "shard_index": p.index, "first_line": p.first_line,
                        "last_line": p.last_line, "num_items": p.num_items, "status": ShardStatus.pending,
                        "input_uri": job_store.uri(keys.shard_input_key(p.index)), "heartbeat_at": t, "created_at": t,
                    }
                    for p in intake.shards
                ],
            )  # fmt: skip
        started = conn.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.validating)
            .values(
                status=JobStatus.in_progress, in_progress_at=t, total_requests=intake.total,
                invalid_requests=intake.invalid, failed_requests=intake.invalid, num_shards=len(intake.shards),
                endpoint=next(iter(intake.endpoints)) if len(intake.endpoints) == 1 else None, updated_at=t,
            )  # fmt: skip
        ).rowcount
    if not started:  # cancelled while validating
        cancel_job(db, store, job_id)
        return get_job(db, job_id)
    if intake.shards and enqueue is not None:
        try:
            enqueue(job_id, [p.index for p in intake.shards])
        except Exception as exc:
            message = f"could not enqueue the job's shards: {type(exc).__name__}: {exc}"
            _fail(db, job_id, "enqueue_failed", message)
            raise SubmitError(f"{message} (job {job_id} marked failed)") from exc
    if not intake.shards:
        finalize_if_ready(db, store, job_id, heartbeat_seconds=settings.heartbeat_seconds)
    return get_job(db, job_id)


def _fail(db: Engine, job_id: str, code: str, message: str) -> None:
    t = now()
    with db.begin() as conn:
        conn.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status=JobStatus.failed, failed_at=t, updated_at=t, errors=[{"code": code, "message": message, "line": None}])
        )
        conn.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == ShardStatus.pending)
            .values(status=ShardStatus.cancelled, finished_at=t)
        )


def get_job(db: Engine, job_id: str, *, refresh: bool = False) -> dict[str, Any]:
    """The batch object; ``refresh`` recomputes a live job's request counts first."""
    keys.check_job_id(job_id)
    with make_sessionmaker(db)() as session:
        job = session.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id}")
        live = JobStatus(job.status) is JobStatus.in_progress or (
            JobStatus(job.status) is JobStatus.cancelling and job.finalizing_at is None
        )
    if refresh and live:  # not while finalising: updated_at is the finaliser's heartbeat
        refresh_job_counts(db, job_id)
    with make_sessionmaker(db)() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.as_batch_object()


def job_status(db: Engine, job_id: str) -> JobStatus:
    with db.connect() as conn:
        status = conn.execute(select(Job.status).where(Job.id == job_id)).scalar_one_or_none()
    if status is None:
        raise JobNotFound(f"no job {job_id}")
    return JobStatus(status)


def cancel_job(db: Engine, store: ObjectStore, job_id: str, *, heartbeat_seconds: float = 10.0) -> dict[str, Any]:
    """Stop a job: no new shard starts, running shards abort their in-flight items within
    ``cancel_poll_seconds``, results so far are kept. Idempotent; a finished job is left as is."""
    keys.check_job_id(job_id)
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
    if finalize_if_ready(db, store, job_id, heartbeat_seconds=heartbeat_seconds) is None:
        _refinalize_if_stalled(db, store, job_id, heartbeat_seconds)
    return get_job(db, job_id)


def _refinalize_if_stalled(db: Engine, store: ObjectStore, job_id: str, heartbeat_seconds: float) -> None:
    """A cancelled job whose finaliser died (claimed long ago, no heartbeat): redo it here."""
    with db.connect() as conn:
        row = conn.execute(select(Job.status, Job.finalizing_at, Job.updated_at).where(Job.id == job_id)).one()
    stale = row.finalizing_at is not None and now() - row.updated_at > 6 * heartbeat_seconds
    if JobStatus(row.status) is JobStatus.cancelling and stale:
        finalize_job(db, store, job_id, heartbeat_seconds=heartbeat_seconds)
