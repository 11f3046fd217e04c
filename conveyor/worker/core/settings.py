"""All worker configuration, read from ``CONVEYOR_*`` environment variables.

With nothing set, everything lives under ``CONVEYOR_HOME`` (default ``~/.conveyor``) and
needs no server: a SQLite database, a local-directory object store and kombu's SQLAlchemy
transport on SQLite as the broker. Production sets ``CONVEYOR_DATABASE_URL`` (Postgres),
``CONVEYOR_BROKER_URL`` (Redis, RabbitMQ, SQS) and ``CONVEYOR_STORAGE_URL``
(``s3://bucket/prefix``; any S3-compatible endpoint via ``AWS_ENDPOINT_URL`` or
``CONVEYOR_STORAGE_ENDPOINT_URL``).

URLs may carry passwords: never log them raw. ``repr(settings)`` and
``settings.safe_dict()`` redact them and the other secrets (the metrics token, the operator's
cache salt); use ``redact_url`` for anything else.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from conveyor.worker.core.catalog import parse_catalog
from conveyor.worker.core.limits import (
    DEFAULT_COMPLETION_WINDOW,
    DEFAULT_LIMITS,
    DEFAULT_MAX_UPLOAD_BYTES,
    MAX_CUSTOM_ID_CHARS,
    MIN_COMPLETION_WINDOW_SECONDS,
    GiB,
    InputLimits,
    KiB,
    MiB,
    completion_window_seconds,
)
from conveyor.worker.core.webhook_signing import check_secret
from conveyor.worker.core.webhook_urls import parse_webhook_urls

_SECRET_QUERY_KEYS = re.compile(r"pass|secret|token|signature|credential|key", re.IGNORECASE)
_URL_FIELDS = ("database_url", "broker_url", "storage_url", "storage_endpoint_url")
# Secrets that are not URLs: shown as "***" when set.
_SECRET_FIELDS = ("metrics_token", "unowned_cache_salt", "webhook_secret")
_QUEUE_PREFIX = re.compile(r"^[A-Za-z0-9_-]{1,24}$")


class ConfigError(ValueError):
    """The configuration cannot work (the message names the setting)."""


def redact_url(url: str | None) -> str | None:
    """``url`` with any password and secret-looking query values replaced by ``***``.

    ``postgresql://u:pw@h/db`` -> ``postgresql://u:***@h/db``; ``redis://:pw@h`` ->
    ``redis://:***@h``; ``...?password=x&X-Amz-Signature=y`` -> both values ``***``.
    """
    if url is None:
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url redacted>"
    out = url
    if "@" in parts.netloc:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if sep else parts.netloc
        out = out.replace(f"//{parts.netloc}", f"//{netloc}", 1)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        query = urlencode([(k, "***" if _SECRET_QUERY_KEYS.search(k) else v) for k, v in pairs], safe="*")
        out = out.replace(f"?{parts.query}", f"?{query}", 1)
    return out


class Settings(BaseSettings):
    """Conveyor's settings. Every field reads ``CONVEYOR_<FIELD NAME>``."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore", frozen=True)

    # Where the embedded database, broker, objects and model cache live when no server is named.
    home: Path = Field(default_factory=lambda: Path("~/.conveyor"))

    # Services: unset, each is the embedded default under ``home`` (see the properties below).

    # The SQLAlchemy URL of the database (PostgreSQL in production); unset: SQLite under home.
    database_url: str | None = None
    # The Celery broker URL (redis://, amqp://, sqs://); unset: kombu's SQLAlchemy transport on SQLite.
    broker_url: str | None = None
    # The object store: s3://bucket/prefix on any S3-compatible store; unset: a directory under home.
    storage_url: str | None = None
    # The S3 endpoint for a non-AWS store; unset: boto3 reads AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL itself.
    storage_endpoint_url: str | None = None

    # Limits on user-provided sizes and counts (defaults in ``conveyor.worker.core.limits``; these fields
    # only add the bounds an operator may set).

    # The largest input file a job may have, in bytes (a bigger one fails the job as a whole).
    max_input_bytes: int = Field(DEFAULT_LIMITS.max_input_bytes, ge=1)
    # The most lines (requests) one job's input may hold.
    max_lines_per_job: int = Field(DEFAULT_LIMITS.max_lines, ge=1)
    # The longest input line, in bytes; a longer one is that line's error.
    max_line_bytes: int = Field(DEFAULT_LIMITS.max_line_bytes, ge=64)
    # The longest ``custom_id``, in characters (at most the database column's 512).
    max_custom_id_chars: int = Field(DEFAULT_LIMITS.max_custom_id_chars, ge=1, le=MAX_CUSTOM_ID_CHARS)
    # The largest ``max_tokens`` (or ``max_completion_tokens``) a request may ask for.
    max_tokens: int = Field(DEFAULT_LIMITS.max_tokens, ge=1)
    # The ``max_tokens`` of a request that names none (at most ``max_tokens``).
    default_max_tokens: int = Field(DEFAULT_LIMITS.default_max_tokens, ge=1)
    # The largest ``n`` (samples per request).
    max_n: int = Field(DEFAULT_LIMITS.max_n, ge=1, le=64)
    # The largest ``logprobs``/``top_logprobs`` (alternatives per token).
    max_logprobs: int = Field(DEFAULT_LIMITS.max_logprobs, ge=0, le=20)
    # The most ``stop`` strings per request (OpenAI allows 4).
    max_stop_sequences: int = Field(DEFAULT_LIMITS.max_stop_sequences, ge=0, le=32)
    # The most ``stop_token_ids`` per request.
    max_stop_token_ids: int = Field(DEFAULT_LIMITS.max_stop_token_ids, ge=0, le=1024)
    # The most ``logit_bias`` entries per request.
    max_logit_bias: int = Field(DEFAULT_LIMITS.max_logit_bias, ge=0, le=1024)
    # The most chat ``messages`` per request.
    max_messages: int = Field(DEFAULT_LIMITS.max_messages, ge=1)
    # The largest shard a submitter may ask for (``--shard-size``), in requests.
    max_shard_size: int = Field(10_000, ge=1)
    # The largest job ``priority`` a submitter may give (lower runs first).
    max_priority: int = Field(1000, ge=0)
    # The largest file ``POST /v1/files`` takes; a bigger one is answered 413 and nothing of it is kept.
    max_upload_bytes: int = Field(DEFAULT_MAX_UPLOAD_BYTES, ge=1)
    # The most requests a ``POST /v1/batches`` input file may hold (OpenAI's 50,000); more is a 400
    # ``too_many_requests``. An operator may raise it; ``CONVEYOR_MAX_LINES_PER_JOB`` still applies.
    batch_max_requests: int = Field(50_000, ge=1)
    # The largest ``POST /v1/batches`` input file, in bytes (OpenAI's 200 MB); larger is a 400
    # ``file_too_large``. An operator may raise it; ``CONVEYOR_MAX_INPUT_BYTES`` still applies.
    batch_max_file_bytes: int = Field(200 << 20, ge=1)
    # The most embedding inputs (each string or token array of a line's ``input``) a
    # ``/v1/embeddings`` batch holds across all its lines (OpenAI's 50,000); more is a 400.
    batch_max_embedding_inputs: int = Field(50_000, ge=1)
    # How long a batch's output and error files are kept after each is written when
    # ``POST /v1/batches`` names no ``output_expires_after`` (OpenAI's 30 days); 0 keeps them until deleted.
    batch_output_expires_after_seconds: int = Field(30 * 86_400, ge=0, le=10 * 365 * 86_400)
    # How often the API server deletes the files past their ``expires_at`` (bytes and row).
    expired_files_interval_seconds: float = Field(300.0, gt=0, le=86_400)
    # How long a Message Batch's results are kept after it is created (Anthropic's 29 days): then
    # the batch shows ``archived_at`` and the API server deletes its results; 0 keeps them until deleted.
    message_batch_results_expire_after_seconds: int = Field(29 * 86_400, ge=0, le=10 * 365 * 86_400)
    # The most requests one Message Batch (``POST /v1/messages/batches``) holds (Anthropic's
    # limit); more is a 400.
    message_batch_max_requests: int = Field(100_000, ge=1)
    # The largest Message Batch create body, in bytes (Anthropic's 256 MB); larger is a 413.
    message_batch_max_bytes: int = Field(256 << 20, ge=1)
    # How many uploads stream at once; one more is answered 429 (the SDK retries it).
    max_concurrent_uploads: int = Field(8, ge=1, le=1024)
    # An upload whose client sends nothing for this long mid-body is answered 408 and dropped.
    upload_idle_timeout_seconds: float = Field(60.0, gt=0)
    # ``conveyor serve``'s connections: a request's headers must all arrive within this (from the
    # connection's start, or the previous response), or the connection is closed.
    http_header_timeout_seconds: float = Field(10.0, gt=0)
    # A JSON request body (``POST /v1/batches``) must all arrive within this (408 otherwise).
    http_body_timeout_seconds: float = Field(30.0, gt=0)
    # An idle keep-alive connection is closed after this.
    http_keep_alive_seconds: float = Field(5.0, gt=0)
    # How many of those uploads one API key may stream at once (one more is answered 429), so
    # one tenant cannot hold every slot.
    max_concurrent_uploads_per_key: int = Field(2, ge=1, le=1024)
    # An upload slower than this on average, once it has run for the idle timeout, is answered
    # 408 and dropped (a byte every few seconds must not hold a slot).
    upload_min_bytes_per_second: int = Field(8 * KiB, ge=0)
    # No upload may take longer than this in all.
    upload_max_seconds: float = Field(3600.0, gt=0)

    # Quotas per owner (an API key): past one, ``POST /v1/files`` or ``POST /v1/batches`` is
    # answered 429 naming it (``conveyor.worker.jobs.quotas``). Work counts as queued from the batch's
    # creation until it ends (completed, failed, expired or cancelled).
    # The most batches one owner may have unfinished at once.
    quota_active_batches: int = Field(100, ge=1)
    # The most request lines one owner's unfinished batches may hold together.
    quota_queued_lines: int = Field(1_000_000, ge=1)
    # The most output tokens one owner's unfinished batches may ask for together: each line's
    # ``n x max_tokens`` (``CONVEYOR_DEFAULT_MAX_TOKENS`` for a line that names none).
    quota_queued_tokens: int = Field(500_000_000, ge=1)
    # The most bytes one owner's files (uploads and batch outputs) may take in the store.
    quota_stored_bytes: int = Field(20 * GiB, ge=1)
    # The most files one owner may keep (uploads and batch outputs).
    quota_files: int = Field(10_000, ge=1)

    # Sharding, leases and write batching.

    # Requests per shard when the submitter names no ``--shard-size``.
    shard_size: int = Field(256, ge=1)
    # How a job's lines are cut into shards when the submitter names no ``--shard-order``: ``prefix``
    # groups lines that share a prompt prefix (each shared document computed once), ``input`` keeps
    # consecutive runs of input lines.
    shard_order: Literal["prefix", "input"] = "prefix"
    # Memory (MiB) intake sorts a grouped job's lines in; beyond it, sorted runs go to temporary
    # files and are merged.
    prefix_sort_memory_mb: int = Field(256, ge=1)
    # How long a shard's lease lasts without a heartbeat before another worker may take it over.
    lease_seconds: float = Field(60.0, gt=0)
    # How often a worker renews its leases and its registry row (at most half of ``lease_seconds``).
    heartbeat_seconds: float = Field(10.0, gt=0)
    # Finished items written to the database per transaction, at most.
    item_commit_batch: int = Field(64, ge=1, le=10_000)
    # Finished items wait at most this long before they are written.
    item_commit_interval_seconds: float = Field(0.5, gt=0)
    # How often a running shard records its progress for ``status``.
    snapshot_interval_seconds: float = Field(5.0, gt=0)
    # The part size of multipart uploads of results files to S3 (5 MiB to 5 GiB, S3's bounds).
    multipart_part_bytes: int = Field(8 * MiB, ge=5 * MiB, le=5 * GiB)

    # The worker.

    # The model a worker serves (``conveyor worker --model``): a hub id, a directory or an s3:// prefix.
    model: str | None = None
    # The public name a worker serves its model under (jobs name it; its queue is named from it).
    served_model_name: str | None = None
    # The deployment's catalog: model names served, comma-separated; accepted while no worker runs.
    models: Annotated[tuple[str, ...], NoDecode] = ()
    # The prefix of every queue name: a model's queue is <prefix>-<model slug>.
    queue_prefix: str = "conveyor"
    # Shard tasks a worker runs at once (threads sharing its one engine).
    worker_concurrency: int = Field(4, ge=1, le=256)
    # The most shards of one owner (API key) a worker runs at once while another owner has work
    # for the model. Unset: one less than ``worker_concurrency`` (at least 1), so a place is left
    # for another owner's shard; an owner alone with work uses every place.
    owner_shard_slots: int | None = Field(None, ge=1, le=256)
    # The worker engine's options: ``EngineConfig`` fields as JSON, e.g. '{"max_num_seqs": 128}'.
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # torch's threads in the worker's engine; unset: the CPUs the process may use, tuned on CPU.
    cpu_threads: int | None = Field(None, ge=1, le=1024)
    # Threads that prepare requests for the engine (chat template, tokenising, grammar compile),
    # off its loop and shared between owners fairly.
    input_threads: int = Field(2, ge=1, le=64)
    # A request's grammar (structured outputs) that takes longer to compile fails alone, ``grammar_too_complex``.
    grammar_compile_seconds: float = Field(10.0, gt=0, le=3600)
    # A request's prompt that takes longer to tokenise fails alone, ``prompt_too_long``.
    tokenize_seconds: float = Field(10.0, gt=0, le=3600)

    # Weights from an object store (``--model s3://bucket/prefix/``), downloaded once per node.

    # Where s3:// weights are cached; unset: $HF_HOME/conveyor-models when HF_HOME is set, else <home>/models.
    model_cache: Path | None = None
    # A model prefix holding more objects than this is refused before anything is downloaded.
    model_max_files: int = Field(1000, ge=1, le=1_000_000)
    # A model prefix holding more bytes than this is refused before anything is downloaded.
    model_max_bytes: int = Field(1024 * GiB, ge=1)
    # Parallel downloads of a model's files.
    model_download_threads: int = Field(8, ge=1, le=64)
    # How a cached copy is checked at each start: ``sha256`` re-hashes every file, ``size`` compares sizes and times.
    model_cache_verify: Literal["sha256", "size"] = "sha256"

    # The broker.

    # Extra kombu transport options as JSON (an SQS region, a Redis global_keyprefix).
    broker_transport_options: dict[str, Any] = Field(default_factory=dict)
    # The Redis/SQS visibility timeout: an unacknowledged message is delivered again after this long.
    broker_visibility_timeout: float = Field(3600.0, gt=0)
    # An AMQP broker that has not answered a call (a prefetch change, a queue declaration) for
    # this long is taken for gone: the call fails and the connection is made again. Without it a
    # broker that stops answering without closing the connection stalls a worker for good.
    broker_read_timeout: float = Field(60.0, gt=0, le=3600)
    # The largest task message a worker takes (a bigger one is refused and logged, not run).
    max_message_bytes: int = Field(1 * MiB, ge=1024)

    # Fault handling (see the fault model in the docs).

    # How often a running shard looks for a cancel of its job.
    cancel_poll_seconds: float = Field(1.0, gt=0)
    # How often each worker sweeps for shards of dead workers, lost messages and expired jobs.
    sweep_interval_seconds: float = Field(15.0, gt=0)
    # Attempts a failing shard gets; only attempts that raised in the worker count (not outages, not deaths).
    shard_max_attempts: int = Field(3, ge=1, le=100)
    # A task holds its message through this much database or storage outage, then hands it back to the broker.
    dependency_retry_seconds: float = Field(900.0, gt=0)
    # A down dependency is checked again with a backoff of at most this long.
    dependency_backoff_max_seconds: float = Field(30.0, gt=0)
    # Deaths of a worker while an item ran alone before that poison item becomes a ``worker_crashed`` error.
    item_max_crashes: int = Field(3, ge=1, le=100)
    # An engine step that has not returned after this long is a hang: the worker exits, handled like a crash.
    step_timeout_seconds: float = Field(600.0, gt=0)
    # The most shards one job may be split into.
    max_shards_per_job: int = Field(100_000, ge=1)
    # A job created by reference still ``validating`` this long after creation gets its intake message again.
    intake_resend_seconds: float = Field(300.0, gt=0)
    # A job folder with no job (an intake that crashed), or the shards of a job that failed to
    # enqueue (``conveyor retry`` runs them), are kept this long, then the storage sweep deletes them.
    storage_grace_seconds: float = Field(86_400.0, gt=0)
    # A worker counts as live while its last heartbeat is at most this old; ``submit`` and ``status`` say when none is.
    worker_live_seconds: float = Field(60.0, gt=0)
    # Workers silent this long leave the registry (each model's newest stays); checked hourly by every worker.
    worker_retention_seconds: float = Field(7 * 86_400.0, gt=0)

    # Completion windows.

    # A job's completion window when its submitter names none ("24h", "1h", "7d", ..., 1h to 30d).
    completion_window: str = DEFAULT_COMPLETION_WINDOW
    # Tests only: the shortest window a job may have, in seconds, so that expiry can be tested in seconds.
    min_completion_window_seconds: int = Field(MIN_COMPLETION_WINDOW_SECONDS, ge=1, le=MIN_COMPLETION_WINDOW_SECONDS)

    # ``conveyor serve`` also consumes the submission queue, so a broker submission is demand while no worker runs.
    api_takes_submissions: bool = True
    # A broker submission's ``reply_to`` (a queue or exchange name) must start with this, so a
    # producer cannot have announcements published into another application's queues; empty:
    # any name but Conveyor's own queues and ``amq.*``.
    reply_to_prefix: str = Field("", max_length=100)

    # Prefix-cache sharing between jobs (``conveyor.worker.execution.cache_salt``): ``owner`` reuses cached
    # prompt blocks only between jobs of one owner (an API key), so no tenant learns another's
    # prompts from ``cached_tokens`` or timing; ``global`` shares them between all jobs (only
    # for a deployment whose users may all see each other's prompts).
    cache_sharing: Literal["owner", "global"] = "owner"
    # The prefix-cache owner of every job submitted without an API key (``conveyor submit``, a
    # broker producer), so the operator's own jobs share their cache; empty: each such job alone.
    unowned_cache_salt: str = Field("", max_length=128)

    # Reasoning models. The parser that splits a model's thinking from its answer: auto (from its
    # family and chat template), none, think (<think>: Qwen3, QwQ, DeepSeek-R1), harmony (gpt-oss), gemma4.
    reasoning_parser: Literal["auto", "none", "think", "harmony", "gemma4"] = "auto"
    # The chat message field the thinking goes to: reasoning (vLLM, OpenRouter) or reasoning_content (DeepSeek).
    reasoning_field: Literal["reasoning", "reasoning_content"] = "reasoning"
    # The thinking budget of a line that names no thinking_token_budget (unset: unbounded thinking).
    thinking_token_budget: int | None = Field(None, ge=0)

    # Webhooks (``conveyor.worker.jobs.webhook_dispatch``): OpenAI's ``batch.*`` events, signed the
    # Standard Webhooks way. The operator's endpoints get every job's events, whatever door it came in by.

    # The operator's endpoints, comma-separated https:// URLs (each checked at every delivery).
    webhook_urls: Annotated[tuple[str, ...], NoDecode] = ()
    # The operator endpoints' signing secret, ``whsec_<base64>`` (Standard Webhooks); needed with ``webhook_urls``.
    webhook_secret: str | None = Field(None, max_length=200)
    # Development only: loopback destinations are allowed (and plain http:// to them).
    webhook_allow_loopback: bool = False
    # A delivery's connect and read timeouts, each, in seconds.
    webhook_timeout_seconds: float = Field(10.0, gt=0, le=60)
    # A failing delivery is retried (backoff from 1 s doubling to an hour) for this long after its event, then failed.
    webhook_max_age_seconds: float = Field(86_400.0, gt=0, le=7 * 86_400)
    # How often each process looks for events to fan out and deliveries that are due.
    webhook_poll_seconds: float = Field(1.0, gt=0, le=300)
    # The most endpoints one API key may register (``POST /v1/webhooks``).
    webhook_max_endpoints_per_key: int = Field(10, ge=1, le=100)
    # A PEM bundle of the CAs destinations' certificates may chain to, instead of the system's (tests, private CAs).
    webhook_ca_bundle: Path | None = None
    # ``conveyor run`` waits up to this long before it exits for its job's webhooks to be delivered.
    webhook_drain_seconds: float = Field(10.0, ge=0, le=600)

    # Metrics.

    # The port of a worker's Prometheus ``/metrics``, ``/healthz`` and ``/readyz`` (0: no metrics server).
    metrics_port: int = Field(0, ge=0, le=65535)
    # When set, every ``/metrics`` (the API's and the workers') answers only a scraper sending
    # ``Authorization: Bearer <this token>``; unset, they are open to whoever reaches the port.
    metrics_token: str | None = Field(None, min_length=16)
    # The address the metrics server listens on (all interfaces, for a scraper outside the container).
    metrics_host: str = "0.0.0.0"
    # Job and shard counts are read from the database at most once per this long per process.
    metrics_cache_seconds: float = Field(5.0, ge=0)

    # Stopping (serverless). Kubernetes' default grace period is 30 s: the default drains within it.

    # On SIGTERM, running shards finish for up to this long, then what is left is handed back and the worker exits 0.
    drain_timeout_seconds: float = Field(25.0, gt=0, le=86_400)
    # With no task for this long, the worker drains and exits 0 (a KEDA ScaledJob); unset: it waits forever.
    exit_when_idle_seconds: float | None = Field(None, gt=0)

    # The log level of worker and server processes (DEBUG, INFO, WARNING...).
    log_level: str = "INFO"

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: Any) -> tuple[str, ...]:
        return parse_catalog(value)

    @field_validator("webhook_urls", mode="before")
    @classmethod
    def _parse_webhook_urls(cls, value: Any) -> tuple[str, ...]:
        return parse_webhook_urls(value)

    @field_validator("webhook_secret")
    @classmethod
    def _check_webhook_secret(cls, value: str | None) -> str | None:
        if value is not None:
            check_secret(value)
        return value

    @field_validator("queue_prefix")
    @classmethod
    def _check_queue_prefix(cls, value: str) -> str:
        if not _QUEUE_PREFIX.match(value):
            raise ValueError(f"CONVEYOR_QUEUE_PREFIX must be 1-24 letters, digits, '_' or '-', got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        try:
            completion_window_seconds(self.completion_window, self.min_completion_window_seconds)
        except ValueError as exc:
            raise ValueError(f"CONVEYOR_COMPLETION_WINDOW: {exc}") from None
        if self.shard_size > self.max_shard_size:
            raise ValueError(
                f"CONVEYOR_SHARD_SIZE={self.shard_size} exceeds CONVEYOR_MAX_SHARD_SIZE={self.max_shard_size}"
            )
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise ValueError(
                f"CONVEYOR_HEARTBEAT_SECONDS={self.heartbeat_seconds} must be at most half of "
                f"CONVEYOR_LEASE_SECONDS={self.lease_seconds}, or a slow heartbeat loses the lease"
            )
        if self.webhook_urls and not self.webhook_secret:
            raise ValueError("CONVEYOR_WEBHOOK_URLS needs CONVEYOR_WEBHOOK_SECRET (whsec_...) to sign the events")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"CONVEYOR_DEFAULT_MAX_TOKENS={self.default_max_tokens} exceeds CONVEYOR_MAX_TOKENS={self.max_tokens}"
            )
        return self

    # ---- resolved locations -------------------------------------------------------------

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def model_cache_dir(self) -> Path:
        """Where ``s3://`` weights are downloaded (``CONVEYOR_MODEL_CACHE``)."""
        if self.model_cache is not None:
            return self.model_cache.expanduser().resolve()
        hf_home = os.environ.get("HF_HOME")
        if hf_home:
            return Path(hf_home).expanduser().resolve() / "conveyor-models"
        return self.home_dir / "models"

    @property
    def database(self) -> str:
        """The SQLAlchemy URL of the database (embedded: SQLite file under home)."""
        return self.database_url or f"sqlite:///{self.home_dir / 'conveyor.db'}"

    @property
    def broker(self) -> str:
        """The Celery broker URL (embedded: kombu's SQLAlchemy transport on SQLite)."""
        return self.broker_url or f"sqla+sqlite:///{self.home_dir / 'broker.db'}"

    @property
    def storage(self) -> str:
        """The object store URL: ``s3://bucket/prefix`` or ``file:///dir`` (embedded)."""
        return self.storage_url or (self.home_dir / "objects").as_uri()

    @property
    def is_embedded(self) -> bool:
        return not (self.database_url or self.broker_url or self.storage_url)

    def ensure_home(self) -> Path:
        """Create the home directory (for the embedded defaults), readable by its user only
        (it holds the database with every prompt and key hash); returns it."""
        home = self.home_dir
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        return home

    @property
    def shard_slots_per_owner(self) -> int:
        """``owner_shard_slots``, or its default from ``worker_concurrency``."""
        if self.owner_shard_slots is not None:
            return self.owner_shard_slots
        return max(1, self.worker_concurrency - 1)

    def input_limits(self) -> InputLimits:
        return InputLimits(
            max_input_bytes=self.max_input_bytes,
            max_lines=self.max_lines_per_job,
            max_line_bytes=self.max_line_bytes,
            max_custom_id_chars=self.max_custom_id_chars,
            max_tokens=self.max_tokens,
            default_max_tokens=self.default_max_tokens,
            max_n=self.max_n,
            max_logprobs=self.max_logprobs,
            max_stop_sequences=self.max_stop_sequences,
            max_stop_token_ids=self.max_stop_token_ids,
            max_logit_bias=self.max_logit_bias,
            max_messages=self.max_messages,
        )

    # ---- safe display -------------------------------------------------------------------

    def safe_dict(self) -> dict[str, Any]:
        """All settings plus the resolved URLs, with secrets redacted: safe to log."""
        data = self.model_dump(mode="json")
        for name in _URL_FIELDS:
            data[name] = redact_url(data[name])
        for name in _SECRET_FIELDS:
            data[name] = "***" if data[name] else data[name]
        data["webhook_urls"] = [redact_url(url) for url in self.webhook_urls]  # a token may ride in a query
        data["resolved"] = {
            "database": redact_url(self.database),
            "broker": redact_url(self.broker),
            "storage": redact_url(self.storage),
        }
        return data

    def __repr_args__(self):  # used by repr() and str()
        for name, value in super().__repr_args__():
            if name in _SECRET_FIELDS and value:
                value = "***"
            if name == "webhook_urls":
                value = tuple(redact_url(url) for url in value)
            yield name, (redact_url(value) if name in _URL_FIELDS else value)


def read_settings(**overrides: Any) -> Settings:
    """Settings from the environment, ``overrides`` (command-line values, None = unset)
    winning; ``ConfigError`` naming each variable that is wrong and why."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(f"invalid settings: {'; '.join(_problem(e) for e in exc.errors())}") from None
    except SettingsError as exc:  # a value that could not even be parsed (e.g. JSON)
        field = _UNPARSEABLE_FIELD.search(str(exc))
        name = f"CONVEYOR_{field.group(1).upper()}" if field else "a CONVEYOR_* variable"
        cause = exc.__cause__
        what = f"is not valid JSON ({cause})" if isinstance(cause, ValueError) else f"cannot be read ({cause or exc})"
        raise ConfigError(f"invalid settings: {name} {what}") from None


_UNPARSEABLE_FIELD = re.compile(r'field "(\w+)"')


def _problem(error: Any) -> str:
    """One pydantic error as ``CONVEYOR_FIELD: what``; a rule across fields says its own names."""
    message = str(error["msg"]).removeprefix("Value error, ")
    field = "_".join(str(part) for part in error["loc"]).upper()
    return f"CONVEYOR_{field}: {message}" if field else message


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return read_settings()
