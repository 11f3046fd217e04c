"""The database schema: SQLAlchemy 2.0 typed models (engines and sessions: ``database``).

Tables: ``jobs`` (mirrors OpenAI's batch object), ``shards`` (a line range of a job, run by
one Celery task under a lease), ``items`` (one finished request, idempotent on
``(job_id, custom_id)``, with its per-item metrics), ``item_crashes`` (items whose worker
died while they ran alone), ``engine_snapshots`` (periodic per-worker engine stats) and
``workers`` (the registry: which worker process serves which model, with a heartbeat),
``api_keys`` (who may call the HTTP API; only a hash of each key is kept), ``files``
(OpenAI Files API objects: uploaded inputs and the batches' output and error files) and
``owner_quota_locks`` (a row per owner, locked while its quotas are checked and used). The
schema changes only through ``conveyor/migrations/``.

Times are Unix epoch seconds (float) everywhere: portable across SQLite and Postgres and
what the OpenAI batch object reports.

A job submitted through the HTTP API names its files by the ids of their ``files`` rows
(``input_file_id``, ``output_file_id``, ``error_file_id``); a job submitted otherwise (CLI,
``Client``, a broker message) has them derived from its id (``batch_<hex>``): ``file-<hex>``
names the stored input, ``file-<hex>-results`` and ``file-<hex>-errors`` the results and
errors files.

``owner`` (on jobs and files) is the id of the API key that created it; ``None`` for what was
created without one (the CLI, ``Client``, a broker message, a server started insecure).
"""

from __future__ import annotations

import enum
import time
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Double,
    Enum,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from conveyor.worker.core.catalog import MAX_MODEL_CHARS
from conveyor.worker.core.limits import DEFAULT_COMPLETION_WINDOW, MAX_CUSTOM_ID_CHARS

# JSON documents: JSONB on Postgres, JSON (text) elsewhere.
JSONType = JSON().with_variant(JSONB(), "postgresql")
# The same, where ``None`` must be SQL NULL rather than JSON ``null`` (a column that a
# partial index or an ``IS NULL`` test reads). Python-side only: the schema is the same.
NullableJSONType = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
# Auto-increment 64-bit keys; SQLite only auto-increments an INTEGER PRIMARY KEY.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")

ID_LEN = 64
URI_LEN = 2048
CUSTOM_ID_LEN = MAX_CUSTOM_ID_CHARS
MODEL_LEN = MAX_MODEL_CHARS
IDEMPOTENCY_KEY_LEN = 256
FILENAME_LEN = 512
# The rows of the partial index ``ix_jobs_unannounced``.
UNANNOUNCED = "notify IS NOT NULL AND notified_at IS NULL"


def now() -> float:
    return time.time()


class JobStatus(str, enum.Enum):
    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"
    # Past its completion window: finished requests kept, the rest ``batch_expired`` errors.
    expired = "expired"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.completed, JobStatus.failed, JobStatus.cancelled, JobStatus.expired)


class ShardStatus(str, enum.Enum):
    pending = "pending"  # waiting for (or between) attempts
    running = "running"  # held under a lease
    completed = "completed"  # part files written
    failed = "failed"  # gave up after the retry limit
    cancelled = "cancelled"


class WorkerState(str, enum.Enum):
    starting = "starting"  # registered, loading its model: not serving yet
    ready = "ready"  # consuming its model's queue
    stopped = "stopped"  # shut down cleanly
    failed = "failed"  # could not start (its ``error`` says why)


class ItemStatus(str, enum.Enum):
    succeeded = "succeeded"
    failed = "failed"


def _str_enum(cls: type[enum.Enum]) -> Enum:
    # VARCHAR + Python-side validation; adding a status needs no schema change.
    return Enum(
        cls,
        native_enum=False,
        create_constraint=False,
        length=16,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    status: Mapped[JobStatus] = mapped_column(_str_enum(JobStatus), default=JobStatus.validating)
    model: Mapped[str] = mapped_column(String(MODEL_LEN))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # The first request's (OpenAI Batch lines must all share it); set at submission.
    endpoint: Mapped[str | None] = mapped_column(String(64))
    input_format: Mapped[str | None] = mapped_column(String(16))  # openai | jsonl | csv
    shard_size: Mapped[int] = mapped_column(Integer)
    num_shards: Mapped[int] = mapped_column(Integer, default=0)

    input_uri: Mapped[str | None] = mapped_column(String(URI_LEN))
    output_uri: Mapped[str | None] = mapped_column(String(URI_LEN))
    error_uri: Mapped[str | None] = mapped_column(String(URI_LEN))

    # request_counts: every input line counts in `total`; `failed` includes `invalid`
    # (lines rejected at validation, which never become items).
    total_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    invalid_requests: Mapped[int] = mapped_column(Integer, default=0)

    # usage aggregates (summed over items at finalisation) and latency metrics (percentiles).
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # of completion_tokens
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONType)

    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)  # job-level errors
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType)

    # OpenAI's completion window ("24h", "7d", ...) and the moment it ends (created_at + window).
    completion_window: Mapped[str] = mapped_column(
        String(16), default=DEFAULT_COMPLETION_WINDOW, server_default=DEFAULT_COMPLETION_WINDOW
    )
    expires_at: Mapped[float | None] = mapped_column(Double)

    created_at: Mapped[float] = mapped_column(Double, default=now)
    updated_at: Mapped[float] = mapped_column(Double, default=now, onupdate=now)
    in_progress_at: Mapped[float | None] = mapped_column(Double)
    finalizing_at: Mapped[float | None] = mapped_column(Double)
    completed_at: Mapped[float | None] = mapped_column(Double)
    failed_at: Mapped[float | None] = mapped_column(Double)
    cancelling_at: Mapped[float | None] = mapped_column(Double)
    cancelled_at: Mapped[float | None] = mapped_column(Double)
    # Set when the job passed its window (it is ``cancelling`` while running shards stop,
    # then ``expired``).
    expired_at: Mapped[float | None] = mapped_column(Double)

    owner: Mapped[str | None] = mapped_column(String(ID_LEN))  # the API key's id, if any
    input_file_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    output_file_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    error_file_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    # A broker-level submission's key: a redelivered or duplicated message finds this job.
    idempotency_key: Mapped[str | None] = mapped_column(String(IDEMPOTENCY_KEY_LEN))
    # Where to announce the job's end on the broker (an outbox: ``notified_at`` is set once
    # the announcement was published; ``conveyor.worker.jobs.announcements``).
    notify: Mapped[dict[str, Any] | None] = mapped_column(NullableJSONType)
    notified_at: Mapped[float | None] = mapped_column(Double)
    # What applies to every line (``conveyor.worker.batchio.request_options``): chat, the system prompt,
    # sampling defaults; NULL when all are at their defaults.
    request_options: Mapped[dict[str, Any] | None] = mapped_column(NullableJSONType)
    # The model as the job was submitted (``model`` is canonical: a local path made absolute);
    # the results' ``model`` field, as OpenAI's responses carry the requested model.
    model_name: Mapped[str | None] = mapped_column(String(MODEL_LEN))
    # How its lines were cut into shards: ``prefix`` (grouped by shared prefix: a shard is a set
    # of lines, its results are merged by line) or ``input`` (consecutive runs); NULL: ``input``.
    shard_order: Mapped[str | None] = mapped_column(String(16))
    # The intake's estimate of the prompts' shared prefix (grouped jobs): canonical prompt bytes
    # and the bytes each line shares with its neighbour in sorted order.
    prefix_estimate: Mapped[dict[str, Any] | None] = mapped_column(NullableJSONType)
    # What the job holds of its owner's quotas until it ends (``conveyor.worker.jobs.quotas``):
    # its lines and output tokens (``n x max_tokens`` per line), fixed when an API batch is
    # created, whatever becomes of its input file; counted by intake for a job created
    # otherwise. NULL until then (charged ``total_requests`` lines of the default meanwhile).
    charged_lines: Mapped[int | None] = mapped_column(BigInteger)
    charged_tokens: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        Index("ix_jobs_status_created", "status", "created_at"),
        Index("ix_jobs_owner_created", "owner", "created_at"),
        Index("ix_jobs_status_expires", "status", "expires_at"),  # the expiry sweep
        UniqueConstraint("idempotency_key", name="uq_jobs_idempotency_key"),
        # The outbox: jobs with an announcement still to publish (few), found without
        # reading every finished job.
        Index(
            "ix_jobs_unannounced",
            "updated_at",
            postgresql_where=text(UNANNOUNCED),
            sqlite_where=text(UNANNOUNCED),
        ),
    )

    def as_batch_object(self) -> dict[str, Any]:
        """The job as OpenAI's batch object (what ``status --json`` and the client show): it
        validates as ``openai.types.Batch``. Extra fields: ``priority``, the files' URIs
        (``input_uri``, ``output_uri``, ``error_uri``), ``metrics``, ``shard_size``, ``num_shards``,
        ``request_options`` (chat, system prompt, sampling defaults)."""

        def ts(value: float | None) -> int | None:
            return None if value is None else int(value)

        if self.input_file_id is not None:  # created through the HTTP API: real Files objects
            input_file_id, output_file_id, error_file_id = self.input_file_id, self.output_file_id, self.error_file_id
        else:
            input_file_id = "file-" + self.id.removeprefix("batch_")
            # Named once written, and only when they hold lines (as OpenAI does).
            output_file_id = f"{input_file_id}-results" if self.output_uri and self.completed_requests else None
            error_file_id = f"{input_file_id}-errors" if self.error_uri and self.failed_requests else None
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "status": JobStatus(self.status).value,
            "completion_window": self.completion_window,
            "input_file_id": input_file_id,
            "output_file_id": output_file_id,
            "error_file_id": error_file_id,
            "priority": self.priority,
            "input_uri": self.input_uri,
            "output_uri": self.output_uri,
            "error_uri": self.error_uri,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "created_at": ts(self.created_at),
            "expires_at": ts(self.expires_at),
            "in_progress_at": ts(self.in_progress_at),
            "finalizing_at": ts(self.finalizing_at),
            "completed_at": ts(self.completed_at),
            "failed_at": ts(self.failed_at),
            "expired_at": ts(self.expired_at),
            "cancelling_at": ts(self.cancelling_at),
            "cancelled_at": ts(self.cancelled_at),
            "request_counts": {
                "total": self.total_requests,
                "completed": self.completed_requests,
                "failed": self.failed_requests,
            },
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens or 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
            "metrics": self.metrics,
            "metadata": self.meta,
            "shard_size": self.shard_size,
            "num_shards": self.num_shards,
            "request_options": self.request_options_shown(),
            "shard_order": self.shard_order or "input",
            "prefix": self.prefix_shown(),
            "progress": None,  # a live job's, filled in by ``conveyor.worker.jobs.progress``
        }

    def prefix_shown(self) -> dict[str, Any]:
        """Prefill computed against prompt tokens, and the intake's estimate of the shared
        prefix (the fraction of prompt bytes a prefix cache need not compute)."""
        prompt, cached = self.prompt_tokens or 0, self.cached_tokens or 0
        est = self.prefix_estimate or {}
        prompt_bytes = est.get("prompt_bytes") or 0
        return {
            "prompt_tokens": prompt,
            "prefill_tokens_computed": prompt - cached,
            "estimated_shared_prefix": round(est.get("shared_prefix_bytes", 0) / prompt_bytes, 4)
            if prompt_bytes
            else None,
        }

    def request_options_shown(self) -> dict[str, Any]:
        """The job's request options as its batch object shows them: ``chat`` as ``auto``,
        ``on`` or ``off``, the system prompt, the sampling defaults."""
        opts = self.request_options or {}
        return {
            "chat": opts.get("chat") or "auto",
            "system_prompt": opts.get("system_prompt"),
            "defaults": opts.get("defaults") or {},
        }


class Shard(Base):
    """A set of a job's valid requests: ``num_items`` of them (listed in its input file), the
    smallest input line ``first_line`` and the largest ``last_line`` (1-based). A job cut in
    input order has consecutive runs (rejected lines in between are not part of one); a job
    grouped by prefix has sets whose lines interleave with other shards'."""

    __tablename__ = "shards"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    shard_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_line: Mapped[int] = mapped_column(Integer)
    last_line: Mapped[int] = mapped_column(Integer)
    num_items: Mapped[int] = mapped_column(Integer)
    status: Mapped[ShardStatus] = mapped_column(_str_enum(ShardStatus), default=ShardStatus.pending)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # leases taken (every start, any reason)
    # Attempts that raised in the worker: counted against CONVEYOR_SHARD_MAX_ATTEMPTS.
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Times a worker died holding it (its lease expired and was taken over). Above zero, its
    # remaining items are suspects: they run in ever smaller groups (``store/crashes.py``).
    deaths: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    solo_item: Mapped[str | None] = mapped_column(String(CUSTOM_ID_LEN))  # the item it runs alone now

    lease_owner: Mapped[str | None] = mapped_column(String(256))
    lease_expires_at: Mapped[float | None] = mapped_column(Double)
    heartbeat_at: Mapped[float | None] = mapped_column(Double)

    input_uri: Mapped[str | None] = mapped_column(String(URI_LEN))  # this shard's requests
    output_uri: Mapped[str | None] = mapped_column(String(URI_LEN))  # part file: results
    # Unused since failed items are read from the database (no errors part file is written).
    error_uri: Mapped[str | None] = mapped_column(String(URI_LEN))
    error: Mapped[str | None] = mapped_column(Text)  # why the shard failed, if it did
    # Grouped by prefix: the prefix its lines share (``conveyor.worker.jobs.shard_cut``); a worker that
    # served it prefers a pending shard with the same key, its prefix cache holding it.
    group_key: Mapped[str | None] = mapped_column(String(32))
    # Its stored items by status, counted when it is released (``record_shard_counts``): the
    # job's running counts are their sums, so a release reads its own items, not the job's.
    succeeded_items: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failed_items: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    created_at: Mapped[float] = mapped_column(Double, default=now)
    started_at: Mapped[float | None] = mapped_column(Double)
    finished_at: Mapped[float | None] = mapped_column(Double)

    __table_args__ = (
        Index("ix_shards_status_lease", "status", "lease_expires_at"),
        Index("ix_shards_group_status", "group_key", "status"),
    )


class Item(Base):
    """One finished request (success or error) with its per-item metrics."""

    __tablename__ = "items"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(CUSTOM_ID_LEN), primary_key=True)
    shard_index: Mapped[int] = mapped_column(Integer)
    line: Mapped[int] = mapped_column(Integer)
    status: Mapped[ItemStatus] = mapped_column(_str_enum(ItemStatus))
    status_code: Mapped[int] = mapped_column(Integer, default=200)
    request_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    response: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # response body
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # {code, message, ...}
    finish_reason: Mapped[str | None] = mapped_column(String(16))

    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(
        Integer, default=0, server_default="0"
    )  # thinking, of completion_tokens
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    queue_time: Mapped[float | None] = mapped_column(Double)  # seconds
    ttft: Mapped[float | None] = mapped_column(Double)  # time to first token
    tpot: Mapped[float | None] = mapped_column(Double)  # time per output token
    e2e: Mapped[float | None] = mapped_column(Double)  # end to end
    worker_id: Mapped[str | None] = mapped_column(String(256))
    finished_at: Mapped[float] = mapped_column(Double, default=now)

    __table_args__ = (
        Index("ix_items_job_shard", "job_id", "shard_index"),
        Index("ix_items_job_line", "job_id", "line"),
    )


class ItemCrash(Base):
    """An item that was running alone when its worker died, and how many times that
    happened: at ``CONVEYOR_ITEM_MAX_CRASHES`` it is a poison item and becomes an error."""

    __tablename__ = "item_crashes"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(CUSTOM_ID_LEN), primary_key=True)
    shard_index: Mapped[int] = mapped_column(Integer)
    crashes: Mapped[int] = mapped_column(Integer, default=0)
    last_worker: Mapped[str | None] = mapped_column(String(256))  # the lease owner that died
    updated_at: Mapped[float] = mapped_column(Double, default=now)

    __table_args__ = (Index("ix_item_crashes_job_shard", "job_id", "shard_index"),)


class EngineSnapshot(Base):
    """A worker's engine stats at one moment (written every few seconds)."""

    __tablename__ = "engine_snapshots"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(MODEL_LEN))
    created_at: Mapped[float] = mapped_column(Double, default=now)
    running: Mapped[int] = mapped_column(Integer, default=0)
    waiting: Mapped[int] = mapped_column(Integer, default=0)
    kv_usage: Mapped[float] = mapped_column(Double, default=0.0)  # fraction of KV blocks in use
    prefix_hit_rate: Mapped[float] = mapped_column(Double, default=0.0)
    tokens_per_s: Mapped[float] = mapped_column(Double, default=0.0)  # generated tokens/s
    prompt_tokens_per_s: Mapped[float] = mapped_column(Double, default=0.0)
    preemptions: Mapped[int] = mapped_column(BigInteger, default=0)  # cumulative
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSONType)

    __table_args__ = (
        Index("ix_engine_snapshots_worker_time", "worker_id", "created_at"),
        Index("ix_engine_snapshots_time", "created_at"),
    )


class Worker(Base):
    """A worker process and the model it serves: written when it starts, every few seconds
    while it runs (``heartbeat_at``) and when it stops, so ``submit`` and ``status`` can say
    when nothing serves a job's model."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(256))
    pid: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(MODEL_LEN))
    queue: Mapped[str] = mapped_column(String(256))
    # What it loaded (a local path or hub id) when ``model`` is a public name given with
    # ``--served-model-name``; ``None`` when it serves the checkpoint under its own name.
    checkpoint: Mapped[str | None] = mapped_column(String(URI_LEN))
    state: Mapped[WorkerState] = mapped_column(_str_enum(WorkerState), default=WorkerState.starting)
    error: Mapped[str | None] = mapped_column(Text)  # why it could not start
    started_at: Mapped[float] = mapped_column(Double, default=now)
    heartbeat_at: Mapped[float] = mapped_column(Double, default=now)

    __table_args__ = (Index("ix_workers_model_heartbeat", "model", "heartbeat_at"),)


class ApiKey(Base):
    """A key to the HTTP API. The key itself is shown once, when created; only its SHA-256
    is kept. A revoked key stays (its files and batches keep their owner) but opens nothing."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex
    created_at: Mapped[float] = mapped_column(Double, default=now)
    revoked_at: Mapped[float | None] = mapped_column(Double)
    last_used_at: Mapped[float | None] = mapped_column(Double)


class StoredFile(Base):
    """An OpenAI Files API object: an upload (purpose ``batch``, ...) or a batch's output or
    error file (purpose ``batch_output``, with ``job_id`` naming the batch)."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(ID_LEN))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(FILENAME_LEN))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    uri: Mapped[str] = mapped_column(String(URI_LEN))
    status: Mapped[str] = mapped_column(String(16), default="processed")  # uploaded | processed | error
    status_details: Mapped[str | None] = mapped_column(Text)
    job_id: Mapped[str | None] = mapped_column(String(ID_LEN))
    # What was learnt while it streamed in (for a batch input: line count, models, endpoints).
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType)
    created_at: Mapped[float] = mapped_column(Double, default=now)
    expires_at: Mapped[float | None] = mapped_column(Double)

    __table_args__ = (
        Index("ix_files_owner_created", "owner", "created_at"),
        Index("ix_files_job", "job_id"),
    )


class OwnerQuotaLock(Base):
    """A row per owner whose quotas were checked: each check takes the owner's row lock with
    the write it allows, in one transaction, so that every API replica takes one owner's turns
    one at a time (``conveyor.worker.store.owner_turns``)."""

    __tablename__ = "owner_quota_locks"

    owner: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)  # "" for no owner
    locked_at: Mapped[float] = mapped_column(Double, default=now)


class WebhookDeliveryStatus(str, enum.Enum):
    pending = "pending"  # to be tried (again) at ``next_attempt_at``
    delivered = "delivered"  # a 2xx answer came back
    failed = "failed"  # given up: refused destination, or still failing after the maximum age


class WebhookEndpoint(Base):
    """An endpoint an API key registered (``POST /v1/webhooks``): it receives the events of that
    key's batches. The operator's endpoints (``CONVEYOR_WEBHOOK_URLS``) are settings, not rows.
    The signing secret is kept as such (the receiver's HMAC needs it); a rotation keeps the
    previous one signing beside it until ``previous_secret_until``."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    owner: Mapped[str] = mapped_column(String(ID_LEN))  # the API key's id
    name: Mapped[str] = mapped_column(String(128), default="")
    url: Mapped[str] = mapped_column(String(URI_LEN))
    event_types: Mapped[list[str]] = mapped_column(JSONType)
    secret: Mapped[str] = mapped_column(String(128))
    previous_secret: Mapped[str | None] = mapped_column(String(128))
    previous_secret_until: Mapped[float | None] = mapped_column(Double)
    created_at: Mapped[float] = mapped_column(Double, default=now)
    updated_at: Mapped[float] = mapped_column(Double, default=now)

    __table_args__ = (Index("ix_webhook_endpoints_owner_created", "owner", "created_at"),)


class WebhookEvent(Base):
    """The outbox: one row per job end (``batch.completed`` ...), written in the transaction
    that ends the job, so an event exists exactly when its state change does. ``payload`` is
    the body every delivery sends; ``fanned_out_at`` is set once its deliveries are made."""

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)  # evt_<hex>
    job_id: Mapped[str] = mapped_column(String(ID_LEN))
    type: Mapped[str] = mapped_column(String(32))
    owner: Mapped[str | None] = mapped_column(String(ID_LEN))  # the job's
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[float] = mapped_column(Double, default=now)
    fanned_out_at: Mapped[float | None] = mapped_column(Double)

    __table_args__ = (
        UniqueConstraint("job_id", "type", name="uq_webhook_events_job_type"),
        Index("ix_webhook_events_fanned_created", "fanned_out_at", "created_at"),
    )


class WebhookDelivery(Base):
    """One event to one endpoint: ``endpoint_id`` names a key's endpoint (``we_...``) or an
    operator URL (``operator-<hash>``), ``url`` where it goes. Claimed under a lease while an
    attempt runs."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str] = mapped_column(String(ID_LEN))
    owner: Mapped[str | None] = mapped_column(String(ID_LEN))  # the endpoint's key; None: the operator's
    url: Mapped[str] = mapped_column(String(URI_LEN))
    status: Mapped[WebhookDeliveryStatus] = mapped_column(
        _str_enum(WebhookDeliveryStatus), default=WebhookDeliveryStatus.pending
    )
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Double, default=now)
    lease_until: Mapped[float | None] = mapped_column(Double)
    last_error: Mapped[str | None] = mapped_column(Text)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Double, default=now)
    updated_at: Mapped[float] = mapped_column(Double, default=now)

    __table_args__ = (
        UniqueConstraint("event_id", "endpoint_id", name="uq_webhook_deliveries_event_endpoint"),
        Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_updated", "updated_at"),
    )
