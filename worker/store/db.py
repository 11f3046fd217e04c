"""The database schema (SQLAlchemy 2.0 typed models) and engine/session helpers.

Tables: ``jobs`` (mirrors OpenAI's batch object), ``shards`` (a line range of a job, run by
one Celery task under a lease), ``items`` (one finished request, idempotent on
``(job_id, custom_id)``, with its per-item metrics) and ``engine_snapshots`` (periodic
per-worker engine stats). The schema changes only through ``migrations/``.

Times are Unix epoch seconds (float) everywhere: portable across SQLite and Postgres and
what the OpenAI batch object reports.
"""

from __future__ import annotations

import enum
import time
from pathlib import Path
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
    event,
)
from sqlalchemy import create_engine as _sa_create_engine
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

# JSON documents: JSONB on Postgres, JSON (text) elsewhere.
JSONType = JSON().with_variant(JSONB(), "postgresql")
# Auto-increment 64-bit keys; SQLite only auto-increments an INTEGER PRIMARY KEY.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")

ID_LEN = 64
URI_LEN = 2048
CUSTOM_ID_LEN = 512  # fits a Postgres btree key even in 4-byte UTF-8
MODEL_LEN = 256


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

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.completed, JobStatus.failed, JobStatus.cancelled)


class ShardStatus(str, enum.Enum):
    pending = "pending"  # waiting for (or between) attempts
    running = "running"  # held under a lease
    completed = "completed"  # part files written
    failed = "failed"  # gave up after the retry limit
    cancelled = "cancelled"


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
    endpoint: Mapped[str | None] = mapped_column(String(64))  # set when all lines share one
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
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONType)

    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)  # job-level errors
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType)

    created_at: Mapped[float] = mapped_column(Double, default=now)
    updated_at: Mapped[float] = mapped_column(Double, default=now, onupdate=now)
    in_progress_at: Mapped[float | None] = mapped_column(Double)
    finalizing_at: Mapped[float | None] = mapped_column(Double)
    completed_at: Mapped[float | None] = mapped_column(Double)
    failed_at: Mapped[float | None] = mapped_column(Double)
    cancelling_at: Mapped[float | None] = mapped_column(Double)
    cancelled_at: Mapped[float | None] = mapped_column(Double)

    __table_args__ = (Index("ix_jobs_status_created", "status", "created_at"),)

    def as_batch_object(self) -> dict[str, Any]:
        """The job as OpenAI's batch object (what ``status --json`` and the client show)."""

        def ts(value: float | None) -> int | None:
            return None if value is None else int(value)

        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "status": JobStatus(self.status).value,
            "priority": self.priority,
            "input_uri": self.input_uri,
            "output_uri": self.output_uri,
            "error_uri": self.error_uri,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "created_at": ts(self.created_at),
            "in_progress_at": ts(self.in_progress_at),
            "finalizing_at": ts(self.finalizing_at),
            "completed_at": ts(self.completed_at),
            "failed_at": ts(self.failed_at),
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
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
            "metrics": self.metrics,
            "metadata": self.meta,
            "shard_size": self.shard_size,
            "num_shards": self.num_shards,
        }


class Shard(Base):
    """A run of a job's valid requests: ``num_items`` of them, from input line ``first_line``
    to ``last_line`` (1-based, inclusive; rejected lines in between are not part of it)."""

    __tablename__ = "shards"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    shard_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_line: Mapped[int] = mapped_column(Integer)
    last_line: Mapped[int] = mapped_column(Integer)
    num_items: Mapped[int] = mapped_column(Integer)
    status: Mapped[ShardStatus] = mapped_column(_str_enum(ShardStatus), default=ShardStatus.pending)
    attempts: Mapped[int] = mapped_column(Integer, default=0)

    lease_owner: Mapped[str | None] = mapped_column(String(256))
    lease_expires_at: Mapped[float | None] = mapped_column(Double)
    heartbeat_at: Mapped[float | None] = mapped_column(Double)

    input_uri: Mapped[str | None] = mapped_column(String(URI_LEN))  # this shard's requests
    output_uri: Mapped[str | None] = mapped_column(String(URI_LEN))  # part file: results
    error_uri: Mapped[str | None] = mapped_column(String(URI_LEN))  # part file: errors
    error: Mapped[str | None] = mapped_column(Text)  # why the shard failed, if it did

    created_at: Mapped[float] = mapped_column(Double, default=now)
    started_at: Mapped[float | None] = mapped_column(Double)
    finished_at: Mapped[float | None] = mapped_column(Double)

    __table_args__ = (Index("ix_shards_status_lease", "status", "lease_expires_at"),)


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


# ---- engines and sessions ---------------------------------------------------------------


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; plain ``postgres(ql)://`` uses the psycopg 3 driver we ship."""
    u = make_url(url) if isinstance(url, str) else url
    if u.drivername in ("postgres", "postgresql"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def create_db_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An Engine for ``url`` tuned for a many-thread worker.

    SQLite: creates the file's directory, WAL journal, a 30 s busy timeout, foreign keys on.
    Postgres: connection liveness checks (``pool_pre_ping``).
    """
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:" and not u.database.startswith("file:"):
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {}).setdefault("timeout", 30)
        engine = _sa_create_engine(u, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return _sa_create_engine(u, **kwargs)


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
    finally:
        cur.close()


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep attribute values after commit (objects stay readable)."""
    return sessionmaker(engine, expire_on_commit=False)
