"""Submitting a job: validate, store and shard the input, create the job, enqueue its shards.

Two ways in. ``submit_job`` streams an input it is handed (the CLI, ``Client``), in the
caller's process. ``create_job`` + ``ingest_job`` take an input already in the object store
(an uploaded file, a broker message's ``s3://`` reference): ``create_job`` records a
``validating`` job at once (idempotent on an ``idempotency_key``), and a worker streams the
input later (``ingest_job``, the ``conveyor.ingest_job`` task).

``submit_job`` validates the input into object storage (``conveyor.worker.jobs.intake``), creates the
job and its shards, and hands the shard indices to ``enqueue`` (one Celery task each; the
in-process ``conveyor run`` passes none and runs the shards itself). A job whose input is
rejected as a whole ends ``failed`` with the reason in ``errors``.

The job records what OpenAI's batch object reports: its completion window and expiry, and
its endpoint, the first valid request's (``/v1/chat/completions`` until one is read, and
for a job with none).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from conveyor.worker.batchio.line_reader import ByteStream
from conveyor.worker.batchio.prefix_signature import grouping_key
from conveyor.worker.batchio.records import InputError, InputFormat
from conveyor.worker.batchio.request_body import CHAT
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import completion_window_seconds
from conveyor.worker.core.settings import Settings
from conveyor.worker.core.storable_text import check_storable
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.cache_salt import cache_salt
from conveyor.worker.jobs.finalize import finalize_if_ready
from conveyor.worker.jobs.intake import Grouping, IntakeResult, ingest
from conveyor.worker.jobs.lifecycle import JobNotFound, cancel_job, get_job
from conveyor.worker.jobs.model_names import canonical_model
from conveyor.worker.jobs.quotas import Charge
from conveyor.worker.jobs.webhook_events import record_job_end
from conveyor.worker.jobs.working_objects import discard_working_objects
from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.faults import dependency_of
from conveyor.worker.store.models import IDEMPOTENCY_KEY_LEN, Job, JobStatus, Shard, ShardStatus, now
from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, ObjectStore

Enqueue = Callable[[str, Sequence[int]], None]

log = logging.getLogger(__name__)


class SubmitError(RuntimeError):
    """The job was created but could not be handed to the broker."""


@dataclass(frozen=True)
class SubmitOptions:
    model: str
    shard_size: int | None = None
    priority: int = 0
    input_format: InputFormat = InputFormat.jsonl
    completion_window: str | None = None  # None: CONVEYOR_COMPLETION_WINDOW
    # Chat, system prompt and sampling defaults for every line (checked by ``check_options``).
    request_options: RequestOptions = field(default_factory=RequestOptions)
    # ``prefix`` (lines grouped by shared prefix) or ``input`` (consecutive runs); None:
    # CONVEYOR_SHARD_ORDER.
    shard_order: str | None = None


SHARD_ORDERS = ("prefix", "input")


# OpenAI's rules for a batch's metadata.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class MetadataError(ValueError):
    """``metadata`` OpenAI would refuse: the message and ``code`` are OpenAI's."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def check_metadata(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    """``metadata`` if OpenAI would take it (at most 16 string pairs, keys of at most 64
    characters, values of at most 512), else ``MetadataError`` saying what is wrong as OpenAI does."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise MetadataError(
            f"Invalid type for 'metadata': expected an object, but got {type(metadata).__name__} instead.",
            "invalid_type",
        )
    if len(metadata) > MAX_METADATA_PAIRS:
        raise MetadataError(
            f"Invalid 'metadata': too many properties. Expected an object with at most {MAX_METADATA_PAIRS} "
            f"properties, but got an object with {len(metadata)} properties instead.",
            "object_above_max_properties",
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise MetadataError(
                f"Invalid type for 'metadata.{key!s:.64}': expected a string, but got {type(value).__name__} instead.",
                "invalid_type",
            )
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise MetadataError(
                f"Invalid 'metadata': key too long. Expected a key with maximum length {MAX_METADATA_KEY_CHARS}, "
                f"but got a key with length {len(key)} instead ({key[:40]!r}...).",
                "string_above_max_length",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise MetadataError(
                f"Invalid 'metadata.{key}': string too long. Expected a string with maximum length "
                f"{MAX_METADATA_VALUE_CHARS}, but got a string with length {len(value)} instead.",
                "string_above_max_length",
            )
        check_storable(key, "metadata key")
        check_storable(value, f"metadata.{key}")
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
    options.request_options.check(settings.input_limits())
    for name, value in (options.request_options.to_json() or {}).items():
        check_storable(value, name)
    if options.shard_order is not None and options.shard_order not in SHARD_ORDERS:
        raise ValueError(f"shard order must be one of {', '.join(SHARD_ORDERS)}, got {options.shard_order!r:.40}")
    return model, shard_size, priority


def _shard_order(settings: Settings, options: SubmitOptions) -> str:
    return settings.shard_order if options.shard_order is None else options.shard_order


def _grouping(
    settings: Settings, shard_order: str | None, job_id: str, owner: str | None, model: str
) -> Grouping | None:
    """How intake groups the job's lines (None: in input order)."""
    if shard_order != "prefix":
        return None
    key = grouping_key(cache_salt(settings, job_id, owner), model)
    return Grouping(key, settings.prefix_sort_memory_mb << 20)


def _window(settings: Settings, options: SubmitOptions) -> tuple[str, float]:
    window = settings.completion_window if options.completion_window is None else options.completion_window
    return window, completion_window_seconds(window, settings.min_completion_window_seconds)


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
    window, window_seconds = _window(settings, options)
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
                request_options=options.request_options.to_json(), model_name=options.model.strip(),
                completion_window=window, created_at=created, updated_at=created,
                expires_at=created + window_seconds, shard_order=_shard_order(settings, options),
            )
        )  # fmt: skip
    if on_created is not None:
        on_created(job_id)
    try:
        intake = ingest(
            source, job_store, job_id, limits=settings.input_limits(), input_format=fmt,
            shard_size=shard_size, max_shards=settings.max_shards_per_job, options=options.request_options,
            grouping=_grouping(settings, _shard_order(settings, options), job_id, None, model),
        )  # fmt: skip
    except InputError as exc:
        _fail(db, job_id, exc.code, str(exc), line=exc.line, param=exc.param, endpoint=exc.endpoint, store=store)
        return get_job(db, job_id)
    except BaseException as exc:
        _fail(db, job_id, "submit_failed", f"the input could not be stored: {type(exc).__name__}")
        raise
    return _start(db, store, settings, job_id, intake, enqueue)


# What a broker message or an API client may put in an idempotency key.
MAX_IDEMPOTENCY_KEY_CHARS = IDEMPOTENCY_KEY_LEN
# The HTTP API's keys are stored as ``api:<owner>:<key>``; no other door may use this prefix.
HTTP_KEY_NAMESPACE = "api:"


def http_idempotency_key(owner: str | None, key: str) -> str:
    """The stored key of an HTTP ``Idempotency-Key``: one owner's never finds another's batch."""
    return f"{HTTP_KEY_NAMESPACE}{owner or '-'}:{key}"


def create_job(
    db: Engine,
    store: ObjectStore,
    settings: Settings,
    input_uri: str,
    options: SubmitOptions,
    *,
    metadata: dict[str, Any] | None = None,
    owner: str | None = None,
    input_file_id: str | None = None,
    idempotency_key: str | None = None,
    notify: dict[str, Any] | None = None,
    charge: Charge | None = None,
    check: Callable[[Connection], None] | None = None,
    job_id: str | None = None,
) -> tuple[dict[str, Any], bool]:
    """A ``validating`` job whose input is already stored (``input_uri``: an object under the
    store's root, e.g. an uploaded file); a worker reads it later (``ingest_job``), so the
    caller (an HTTP request, a broker message) does not stream a large input itself.

    Returns (batch object, created). A job that already has ``idempotency_key`` is returned
    as it is, with ``created`` False: a redelivered or duplicated request makes one job, even
    when both arrive at once. ``ValueError`` names a bad option, a URI outside the store or an
    input that is not there.

    ``charge``: what the job holds of its owner's quotas until it ends (None: what its intake
    will count). ``check`` runs first in the transaction that inserts the job (a quota
    check: what it raises refuses the job). ``job_id``: the id of a job whose input a door
    stored under the job's own prefix before creating it (the Message Batches door)."""
    model, shard_size, priority = check_options(settings, options)
    window, window_seconds = _window(settings, options)
    metadata = check_metadata(metadata)
    fmt = InputFormat(options.input_format)
    if idempotency_key is not None:
        if not isinstance(idempotency_key, str) or not 1 <= len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_CHARS:
            raise ValueError(
                f"idempotency_key must be a string of 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters, "
                f"got {idempotency_key!r:.80}"
            )
        check_storable(idempotency_key, "idempotency_key")
        existing = job_with_key(db, idempotency_key)
        if existing is not None:
            return existing, False
    try:
        key = store.key_of(input_uri)
    except InvalidKey as exc:
        raise ValueError(f"input_uri: {exc}") from None
    if not store.exists(key):
        raise ValueError(f"input_uri: there is no object at {input_uri!r:.300}")
    job_id = object_keys.check_job_id(job_id) if job_id is not None else object_keys.new_job_id()
    created = now()
    try:
        with db.begin() as conn:
            if check is not None:
                check(conn)
            conn.execute(
                insert(Job).values(
                    id=job_id, status=JobStatus.validating, model=model, priority=priority,
                    endpoint=options.request_options.endpoint or CHAT,
                    input_format=fmt.value, shard_size=shard_size, meta=metadata, input_uri=store.uri(key),
                    completion_window=window, created_at=created, updated_at=created,
                    expires_at=created + window_seconds, owner=owner, input_file_id=input_file_id,
                    idempotency_key=idempotency_key, notify=notify,
                    request_options=options.request_options.to_json(), model_name=options.model.strip(),
                    shard_order=_shard_order(settings, options),
                    charged_lines=None if charge is None else charge.lines,
                    charged_tokens=None if charge is None else charge.tokens,
                )
            )  # fmt: skip
    except IntegrityError:
        existing = job_with_key(db, idempotency_key) if idempotency_key is not None else None
        if existing is None:
            raise
        return existing, False  # a duplicate won the race
    return get_job(db, job_id), True


def job_request_options(db: Engine, job_id: str) -> RequestOptions:
    """The request options job ``job_id`` was created with (the defaults if there is none)."""
    with db.connect() as conn:
        stored = conn.execute(select(Job.request_options).where(Job.id == job_id)).scalar_one_or_none()
    return RequestOptions.from_json(stored)


def job_with_key(db: Engine, idempotency_key: str) -> dict[str, Any] | None:
    """The batch object of the job created under ``idempotency_key``, if any."""
    with db.connect() as conn:
        job_id = conn.execute(select(Job.id).where(Job.idempotency_key == idempotency_key)).scalar_one_or_none()
    return None if job_id is None else get_job(db, job_id)


def ingest_job(
    db: Engine, store: ObjectStore, settings: Settings, job_id: str, *, enqueue: Enqueue | None
) -> dict[str, Any]:
    """Stream a ``create_job`` job's stored input, validate and shard it, start the job and
    enqueue its shards; returns the batch object.

    Idempotent: a job no longer ``validating`` is returned as it is, and two runs at once
    (a redelivered message) write the same shard files and start the job once. An input
    rejected as a whole, or gone, fails the job with the reason; an outage raises (the
    caller retries)."""
    with db.connect() as conn:
        row = conn.execute(
            select(
                Job.status,
                Job.input_uri,
                Job.input_format,
                Job.shard_size,
                Job.request_options,
                Job.shard_order,
                Job.owner,
                Job.model,
            ).where(Job.id == job_id)
        ).one_or_none()
    if row is None:
        raise JobNotFound(f"no job {job_id}")
    if JobStatus(row.status) is not JobStatus.validating:
        return get_job(db, job_id)
    job_store = store.scoped(object_keys.job_prefix(job_id))
    fmt = InputFormat(row.input_format or InputFormat.jsonl.value)
    try:
        source = store.open_read(store.key_of(row.input_uri))
    except (InvalidKey, ObjectNotFound) as exc:
        _fail(db, job_id, "input_not_found", f"the job's input cannot be read: {exc}", store=store)
        return get_job(db, job_id)
    with source:
        try:
            intake = ingest(
                source, job_store, job_id, limits=settings.input_limits(), input_format=fmt,
                shard_size=row.shard_size, max_shards=settings.max_shards_per_job, copy_input=False,
                options=RequestOptions.from_json(row.request_options),
                grouping=_grouping(settings, row.shard_order, job_id, row.owner, row.model),
            )  # fmt: skip
        except InputError as exc:
            _fail(db, job_id, exc.code, str(exc), line=exc.line, param=exc.param, endpoint=exc.endpoint, store=store)
            return get_job(db, job_id)
        except Exception as exc:
            if dependency_of(exc) is not None:
                raise  # an outage: the caller retries
            # Anything else would fail the same way on every retry, for the whole window.
            log.exception("the intake of job %s failed", job_id)
            _fail(db, job_id, "intake_failed", f"the input could not be taken in ({type(exc).__name__})")
            return get_job(db, job_id)
    return _start(db, store, settings, job_id, intake, enqueue)


def _start(
    db: Engine, store: ObjectStore, settings: Settings, job_id: str, intake: IntakeResult, enqueue: Enqueue | None
) -> dict[str, Any]:
    """Create the shards of an ingested job, move it to ``in_progress`` and enqueue them. Only
    the run that moves it from ``validating`` does so (the row lock orders concurrent runs)."""
    t = now()
    with db.begin() as conn:
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
                endpoint=intake.endpoint or Job.endpoint,  # an API batch's stays, even with no valid line
                # A job created without a charge is charged what intake counted.
                charged_lines=func.coalesce(Job.charged_lines, intake.total),
                charged_tokens=func.coalesce(Job.charged_tokens, intake.tokens),
                prefix_estimate=None if intake.prefix is None else intake.prefix.to_json(),
                updated_at=t,
            )
        ).rowcount
        if started and intake.shards:
            job_store = store.scoped(object_keys.job_prefix(job_id))
            conn.execute(
                insert(Shard),
                [
                    {
                        "job_id": job_id, "shard_index": p.index, "first_line": p.first_line,
                        "last_line": p.last_line, "num_items": p.num_items, "status": ShardStatus.pending,
                        "group_key": p.group_key,
                        "input_uri": job_store.uri(object_keys.shard_input_key(p.index)),
                        "heartbeat_at": t, "created_at": t,
                    }
                    for p in intake.shards
                ],
            )  # fmt: skip
    if not started:
        if JobStatus(get_job(db, job_id)["status"]) is JobStatus.cancelling:  # cancelled while validating
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
    store: ObjectStore | None = None,
) -> None:
    """The job ``failed``, with one error shaped as OpenAI's ``BatchError``; with ``store``,
    what its intake wrote is deleted (it can never run)."""
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
        failed = conn.execute(update(Job).where(Job.id == job_id).values(**values)).rowcount
        if failed:
            record_job_end(conn, job_id, JobStatus.failed, t)
        conn.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.status == ShardStatus.pending)
            .values(status=ShardStatus.cancelled, finished_at=t)
        )
    if store is not None:
        discard_working_objects(store, job_id)
