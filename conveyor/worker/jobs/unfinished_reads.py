"""A job's unfinished input as its user reads it (``conveyor results --unfinished``,
``GET /v1/batches/{id}/unfinished``). A job with no owner has it stored by its finaliser
(``unfinished``), its input copy being gone by then. An owner's batch keeps no such copy,
which would be stored outside the owner's quotas: its lines are taken from its input file
when asked, as long as the owner keeps that file."""

from __future__ import annotations

import io
import tempfile
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.engine import Engine

from conveyor.worker.batchio.input_subset import write_subset
from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.files import expiry_time, outputs_expired_at
from conveyor.worker.jobs.lifecycle import JobNotFound
from conveyor.worker.jobs.unfinished import unrun_lines
from conveyor.worker.store.models import Job, JobStatus
from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, ObjectStore

# An owner's unfinished lines are gathered in memory up to this size, then on local disk.
_SPOOL_BYTES = 8 << 20


class NotEnded(RuntimeError):
    """The job still runs: which of its lines stay unfinished is known once it ends."""


class NoUnfinished(LookupError):
    """The job has no unfinished input to give (the message says why)."""


def open_unfinished(db: Engine, root_store: ObjectStore, job_id: str) -> BinaryIO:
    """The job's unfinished input lines as stored; empty for a job that completed (every line
    was answered)."""
    object_keys.check_job_id(job_id)
    with db.connect() as conn:
        job = conn.execute(
            select(Job.status, Job.input_format, Job.owner, Job.input_uri, Job.input_file_id, Job.metrics).where(
                Job.id == job_id
            )
        ).one_or_none()
    if job is None:
        raise JobNotFound(f"no job {job_id}")
    status = JobStatus(job.status)
    if not status.terminal:
        raise NotEnded(
            f"job {job_id} is {status.value}: its unfinished lines are known once it ends (cancel it to end it now)"
        )
    if status is JobStatus.completed:
        return io.BytesIO(b"")
    if status is JobStatus.failed:
        raise NoUnfinished(f"job {job_id} failed as a whole before running: submit its input again")
    expired = outputs_expired_at(job.metrics)
    if expired is not None:  # which lines never ran went with its items
        raise NoUnfinished(f"job {job_id}'s output files expired at {expiry_time(expired)} and were deleted")
    fmt = InputFormat(job.input_format or InputFormat.jsonl.value)
    if job.owner is not None:
        return _from_input_file(db, root_store, job_id, fmt, job.input_uri, job.input_file_id)
    key = object_keys.unfinished_key(fmt.value)
    try:
        return root_store.scoped(object_keys.job_prefix(job_id)).open_read(key)
    except ObjectNotFound:
        raise NoUnfinished(
            f"job {job_id} has no unfinished input: its input was gone when it ended (its errors file names the "
            "requests that never ran)"
        ) from None


def _from_input_file(
    db: Engine, root_store: ObjectStore, job_id: str, fmt: InputFormat, input_uri: str | None, file_id: str | None
) -> BinaryIO:
    if not file_id:
        raise NoUnfinished(
            f"job {job_id} keeps no input to take its unfinished lines from: its errors file names the requests "
            "that never ran"
        )
    try:
        stream = root_store.open_read(root_store.key_of(input_uri or ""))
    except (InvalidKey, ObjectNotFound):
        raise NoUnfinished(
            f"job {job_id}'s input file {file_id} was deleted: its errors file names the requests that never ran"
        ) from None
    out = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)  # noqa: SIM115 - handed to the caller, who closes it
    with stream:
        write_subset(stream, fmt, unrun_lines(db, job_id), out.write)
    out.seek(0)
    return out  # type: ignore[return-value]  # SpooledTemporaryFile reads as a BinaryIO
