"""The settings of the HTTP API's bounds and timeouts."""

from __future__ import annotations

from pydantic import BaseModel, Field

from conveyor.worker.core.limits import DEFAULT_MAX_UPLOAD_BYTES, KiB


class ApiSettings(BaseModel):
    """HTTP API.

    The bounds of ``conveyor serve``: uploads, batch and Message Batch sizes, how long their files
    are kept, and its connections' timeouts.
    """

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
