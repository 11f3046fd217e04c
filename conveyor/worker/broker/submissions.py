"""Taking a ``conveyor.submit_job`` message (the contract: ``conveyor.worker.broker.submission_contract``).

1. The message is checked field by field (``parse_submission``). A key that already names a
   job (a duplicate, a redelivery) makes nothing new: that job is the answer. A key reused
   for a different submission (another input, model, window, priority, shard size,
   metadata or request options) is refused and changes nothing: a key names one submission, as an HTTP
   ``Idempotency-Key`` does.
2. Its input must be an object under the configured store (``ObjectStore.key_of``), not one
   of Conveyor's own job objects (``jobs/...``), that this worker can read: its first bytes
   are read, and with its name give its format when the message names none (as
   ``conveyor submit`` detects it).
3. ``create_job`` records the job ``validating`` under the key (two copies of the message
   arriving at once still make one job).
4. While the job is ``validating``, ``conveyor.ingest_job`` goes to the intake queue, where
   a worker streams the input into shards (``ingest_job``: idempotent, so the redelivery of a
   message whose worker died after step 3 sends it again, harmlessly).

The message is acknowledged only after step 4 (late acks): a worker that dies before has it
delivered again, and the steps above make that safe. A refused message is answered as the
contract says (recorded and announced when its key is valid, logged in any case), then
acknowledged: it is never retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from sqlalchemy.engine import Engine

from conveyor.worker.batchio.readers import detect_format
from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.broker.announce import describe_target
from conveyor.worker.broker.submission_contract import InvalidSubmission, Submission, parse_submission
from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.catalog import lookup, not_served
from conveyor.worker.jobs.keyed_submissions import job_with_key, record_refusal
from conveyor.worker.jobs.submission import SubmitOptions, create_job
from conveyor.worker.store.faults import dependency_of
from conveyor.worker.store.models import JobStatus
from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)

HEAD_BYTES = 4096  # what format detection reads of the input
JOBS_PREFIX = "jobs/"  # Conveyor's own objects (``conveyor.worker.jobs.object_keys``)


class IntakeNotSent(RuntimeError):
    """A submission's job exists but its intake could not be enqueued: the submission message
    goes back to the broker, and its redelivery enqueues the intake again."""


def intake_sender(send: Callable[[str], None]) -> Callable[[str], None]:
    """``send`` (enqueue a job's intake), raising ``IntakeNotSent`` when the broker, which has
    just delivered the submission, cannot take the intake message now."""

    def intake(job_id: str) -> None:
        try:
            send(job_id)
        except Exception as exc:
            raise IntakeNotSent(f"could not enqueue the intake of job {job_id}: {type(exc).__name__}: {exc}") from exc

    return intake


def input_key(store: ObjectStore, uri: str) -> str:
    """The store key of a submission's input; ``ValueError`` (naming ``input_uri``) when the
    URI is outside the store or names one of Conveyor's own job objects."""
    try:
        key = store.key_of(uri)
    except InvalidKey as exc:
        raise ValueError(f"input_uri: {exc}") from None
    if key.startswith(JOBS_PREFIX):
        raise ValueError(f"input_uri: {uri!r:.300} is one of Conveyor's own job objects, not an input")
    return key


def detect_input_format(store: ObjectStore, key: str, uri: str) -> InputFormat:
    """The input's format from its first bytes and its name; ``ValueError`` when it cannot be
    read (an outage of the store is raised as is: the caller waits for it)."""
    try:
        with store.open_read(key) as f:
            head = f.read(HEAD_BYTES)
    except ObjectNotFound:
        raise ValueError(f"input_uri: there is no object at {uri!r:.300}") from None
    except Exception as exc:
        if dependency_of(exc) is not None:
            raise
        raise ValueError(f"input_uri: {uri!r:.300} cannot be read: {type(exc).__name__}: {exc}") from None
    return detect_format(PurePosixPath(key).name, head)


def handle_submission(
    db: Engine,
    store: ObjectStore,
    settings: Settings,
    args: Any,
    kwargs: Any,
    *,
    enqueue_intake: Callable[[str], None],
    announce: Callable[[str], object],
    task_id: str | None = None,
) -> dict[str, Any]:
    """Take one submission message (its Celery ``args`` and ``kwargs``); returns what became
    of it: ``job_id`` (None when refused and not recorded), ``status``, ``created``, and
    ``refused`` (the reason, or None). Safe to call again with the same message."""
    try:
        sub = parse_submission(args, kwargs, settings)
    except InvalidSubmission as exc:
        return _refuse(db, settings, exc, kwargs, announce, task_id)
    job = job_with_key(db, sub.idempotency_key)
    created = False
    if job is None and lookup(db, settings, sub.model) is None:  # no job, nor queue, for any name sent
        refusal = InvalidSubmission(
            not_served(sub.model), param="model", idempotency_key=sub.idempotency_key, reply_to=sub.reply_to
        )
        return _refuse(db, settings, refusal, kwargs, announce, task_id)
    if job is None:
        try:
            key = input_key(store, sub.input_uri)
            detected = detect_input_format(store, key, sub.input_uri)  # and it is there, and readable
            fmt = sub.input_format or detected
            options = SubmitOptions(
                model=sub.model, shard_size=sub.shard_size, priority=sub.priority, input_format=fmt,
                completion_window=sub.completion_window, request_options=sub.request_options,
            )  # fmt: skip
            job, created = create_job(
                db, store, settings, sub.input_uri, options,
                metadata=sub.metadata, idempotency_key=sub.idempotency_key, notify=sub.reply_to,
            )  # fmt: skip
        except ValueError as exc:  # the input's checks and create_job's (a message naming input_uri or the option)
            message = str(exc)
            param = "input_uri" if message.startswith("input_uri:") else None
            refusal = InvalidSubmission(
                message, param=param, idempotency_key=sub.idempotency_key, reply_to=sub.reply_to
            )
            return _refuse(db, settings, refusal, kwargs, announce, task_id)
    job_id, status = job["id"], JobStatus(job["status"])
    if not created and (differs := fields_differing(job, sub)):
        reason = (
            f"idempotency_key {sub.idempotency_key!r} already names job {job_id}, submitted with a different "
            f"{', '.join(differs)}; send a new submission under a new key"
        )
        log.error("refused submission (task %s): %s; job %s is left as it is", task_id, reason, job_id)
        return {"job_id": job_id, "status": status.value, "created": False, "refused": reason}
    if status is JobStatus.validating:
        enqueue_intake(job_id)  # again for a redelivery: the job may never have been ingested
    if created:
        log.info("submission %r (task %s): job %s created from %s", sub.idempotency_key, task_id, job_id, sub.input_uri)
    else:
        log.info("submission %r (task %s) names job %s already (%s): nothing created",
                 sub.idempotency_key, task_id, job_id, status.value)  # fmt: skip
    if status.terminal:
        announce(job_id)  # a duplicate of a finished job: publishes only if still due
    return {"job_id": job_id, "status": status.value, "created": created, "refused": None}


def fields_differing(job: dict[str, Any], sub: Submission) -> list[str]:
    """The submission's fields that differ from the job its key names (fields the message left
    to their defaults are not compared). A recorded refusal (no input) is the key's answer to
    whatever comes under it, so nothing differs from it."""
    if job.get("input_uri") is None:
        return []
    asked: dict[str, Any] = {
        "input_uri": sub.input_uri,
        "model": sub.model,
        "priority": sub.priority,
        "metadata": sub.metadata or None,
        "request_options": sub.request_options.shown(),
    }
    if sub.completion_window is not None:
        asked["completion_window"] = sub.completion_window
    if sub.shard_size is not None:
        asked["shard_size"] = sub.shard_size
    return [name for name, value in asked.items() if (job.get(name) or None) != (value or None)]


def _refuse(
    db: Engine,
    settings: Settings,
    exc: InvalidSubmission,
    kwargs: Any,
    announce: Callable[[str], object],
    task_id: str | None,
) -> dict[str, Any]:
    reason = str(exc)
    key = exc.idempotency_key
    if key is None:
        log.error("refused a submission (task %s): %s; dropped (no valid idempotency_key to record it under)",
                  task_id, reason)  # fmt: skip
        return {"job_id": None, "status": None, "created": False, "refused": reason}
    fields = kwargs if isinstance(kwargs, dict) else {}
    job, created = record_refusal(
        db, settings, idempotency_key=key, code=exc.code, message=reason, param=exc.param,
        model=fields.get("model"), metadata=fields.get("metadata"), notify=exc.reply_to,
    )  # fmt: skip
    if created:
        where = f"; announced to {describe_target(exc.reply_to)}" if exc.reply_to else ""
        log.warning("refused submission %r (task %s): %s; recorded as failed job %s%s",
                    key, task_id, reason, job["id"], where)  # fmt: skip
    else:
        log.warning("refused a copy of submission %r (task %s): %s; the key names job %s already (%s)",
                    key, task_id, reason, job["id"], job["status"])  # fmt: skip
    if JobStatus(job["status"]).terminal:
        announce(job["id"])
    return {"job_id": job["id"], "status": job["status"], "created": created, "refused": reason}
