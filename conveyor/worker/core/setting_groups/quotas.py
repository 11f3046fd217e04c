"""The settings of the quotas per owner."""

from __future__ import annotations

from pydantic import BaseModel, Field

from conveyor.worker.core.limits import GiB


class QuotaSettings(BaseModel):
    """Quotas.

    Quotas per owner (an API key).
    """

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
