"""Submitting a job: validate, store and shard the input, create the job, enqueue its shards.

``submit_job`` validates the input into object storage (``worker.jobs.intake``), creates the
job and its shards, and hands the shard indices to ``enqueue`` (one Celery task each; the
in-process ``conveyor run`` passes none and runs the shards itself). A job whose input is
rejected as a whole ends ``failed`` with the reason in ``errors``.

The job records what OpenAI's batch object reports: its completion window and expiry, and
its endpoint, the first valid request's (``/v1/chat/completions`` until one is read, and
for a job with none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.engine import Engine

from worker.batchio.line_reader import ByteStream
from worker.batchio.records import InputError, InputFormat
from worker.batchio.request_body import CHAT
from worker.core.limits import completion_window_seconds
from worker.core.settings import Settings
from worker.jobs import object_keys
from worker.jobs.finalize import finalize_if_ready
from worker.jobs.intake import ingest
from worker.jobs.lifecycle import cancel_job, get_job
from worker.jobs.model_names import canonical_model
from worker.store.database import make_sessionmaker
from worker.store.models import Job, JobStatus, Shard, ShardStatus, now
from worker.store.objects.base import ObjectStore

Enqueue = Callable[[str, Sequence[int]], None]


class SubmitError(RuntimeError):
    """The job was created but could not be handed to the broker."""


@dataclass(frozen=True)
class SubmitOptions:
    model: str
    shard_size: int | None = None
    priority: int = 0
    input_format: InputFormat = InputFormat.jsonl
    completion_window: str | None = None  # None: CONVEYOR_COMPLETION_WINDOW


# OpenAI's rules for a batch's metadata.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    """``metadata`` if OpenAI would take it (at most 16 string pairs, keys of at most 64
    characters, values of at most 512), else ``ValueError`` saying what is wrong."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata must be a dict of at most {MAX_METADATA_PAIRS} key-value pairs")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata keys and values must be strings, got {key!r:.70}: {value!r:.70}")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"metadata keys must be at most {MAX_METADATA_KEY_CHARS} characters, got {key!r:.70}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata values must be at most {MAX_METADATA_VALUE_CHARS} characters (key {key!r})")
    return dict(metadata)


def check_options(settings: Settings, options: SubmitOptions) -> tuple[str, int, int]:
    """(canonical model, shard size, priority), or ``ValueError`` naming the bad value."""
    model = canonical_model(options.model)
    shard_size = settings.shard_size if options.shard_size is None else options.shard_size
    if (
        isinstance(shard_size, bool)
        or not isinstance(shard_size, int)
        or not 1 <= shard_size <= settings.max_shard_size
    ):
        raise ValueError(
            f"shard size must be an integer from 1 to {settings.max_shard_size} "
            f"(CONVEYOR_MAX_SHARD_SIZE), got {shard_size!r}"
        )
    priority = options.priority
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= settings.max_priority:
        raise ValueError(
            f"priority must be an integer from 0 to {settings.max_priority} (CONVEYOR_MAX_PRIORITY), got {priority!r}"
        )
    return model, shard_size, priority


def submit_job(
    db: Engine,
    store: ObjectStore,
    settings: Settings,
    source: ByteStream,
    options: SubmitOptions,
    *,
    enqueue: Enqueue | None,
    metadata: dict[str, Any] | None = None,
    on_created: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Validate, store and shard the input, create the job; returns the batch object.
    ``on_created(job_id)`` runs once the job row exists (an interrupted caller can name it)."""
    model, shard_size, priority = check_options(settings, options)
    window = settings.completion_window if options.completion_window is None else options.completion_window
    window_seconds = completion_window_seconds(window, settings.min_completion_window_seconds)
    metadata = check_metadata(metadata)
    job_id = object_keys.new_job_id()
    job_store = store.scoped(object_keys.job_prefix(job_id))
    fmt = InputFormat(options.input_format)
    sessions = make_sessionmaker(db)
    created = now()
    with sessions.begin() as session:
        session.add(
            Job(
                id=job_id, status=JobStatus.validating, model=model, priority=priority, endpoint=CHAT,
                input_format=fmt.value, shard_size=shard_size, meta=metadata,
                input_uri=job_store.uri(object_keys.input_key(fmt.value)),
                completion_window=window, created_at=created, updated_at=created,
                expires_at=created + window_seconds,
            )
        )  # fmt: skip
    if on_created is not None:
        on_created(job_id)
    try:
        intake = ingest(
            source, job_store, job_id, limits=settings.input_limits(), input_format=fmt,
            shard_size=shard_size, max_shards=settings.max_shards_per_job,
        )  # fmt: skip
    except InputError as exc:
        _fail(db, job_id, exc.code, str(exc), line=exc.line, param=exc.param, endpoint=exc.endpoint)
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
                        "input_uri": job_store.uri(object_keys.shard_input_key(p.index)),
                        "heartbeat_at": t, "created_at": t,
                    }
                    for p in intake.shards
                ],
            )  # fmt: skip
        started = conn.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.validating)
            .values(
                status=JobStatus.in_progress,
                in_progress_at=t,
                total_requests=intake.total,
                invalid_requests=intake.invalid,
                failed_requests=intake.invalid,
                num_shards=len(intake.shards),
                endpoint=intake.endpoint or CHAT,
                updated_at=t,
            )
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


def _fail(
    db: Engine,
    job_id: str,
    code: str,
    message: str,
    *,
    line: int | None = None,
    param: str | None = None,
    endpoint: str | None = None,
) -> None:
    """The job ``failed``, with one error shaped as OpenAI's ``BatchError``."""
    t = now()
    values: dict[str, Any] = {
        "status": JobStatus.failed,
        "failed_at": t,
        "updated_at": t,
        "errors": [{"code": code, "message": message, "param": param, "line": line}],
    }
    if endpoint is not None:
        values["endpoint"] = endpoint
    with db.begin() as conn:
        conn.execute(update(Job).where(Job.id == job_id).values(**values))
        conn.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == ShardStatus.pending)
            .values(status=ShardStatus.cancelled, finished_at=t)
        )
