"""The owner's quotas (``conveyor.worker.jobs.quotas``) at the API's doors, answered 429 as OpenAI
answers a rate limit: ``code`` ``rate_limit_exceeded``, ``param`` the limit's name, and a
message giving the limit, the usage and what was asked (the ``openai`` SDK raises
``RateLimitError``).

Files: before the body is read (the files count, and the bytes already stored plus the
declared length), then again before the upload is recorded, with its real size (nothing is
kept past a quota). Batches: before the job is recorded, with the file's lines and tokens.
One owner's checks and the writes they allow take turns (``OwnerLocks``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from starlette.requests import Request

from conveyor.worker.api.errors import ApiError
from conveyor.worker.api.services import ApiServices
from conveyor.worker.api.uploads import MULTIPART_OVERHEAD
from conveyor.worker.batchio.batch_scan import BatchScan
from conveyor.worker.jobs.files import FileUpload
from conveyor.worker.jobs.quotas import (
    OwnerLocks,
    QuotaExceeded,
    Quotas,
    check_batch,
    check_store,
    queued_work,
    stored_usage,
)

T = TypeVar("T")

RATE_LIMITED = "rate_limit_exceeded"

_LOCKS = OwnerLocks()


def quota_error(exc: QuotaExceeded) -> ApiError:
    return ApiError(429, str(exc), param=exc.limit, code=RATE_LIMITED)


def _holding(owner: str | None, fn: Callable[[], T]) -> T:
    _LOCKS.acquire(owner)
    try:
        return fn()
    except QuotaExceeded as exc:
        raise quota_error(exc) from None
    finally:
        _LOCKS.release(owner)


def check_upload_start(services: ApiServices, owner: str | None, declared_bytes: int) -> None:
    """429 if one more file (of at least ``declared_bytes``) would pass the owner's quotas."""
    quotas = Quotas.from_settings(services.settings)
    _holding(owner, lambda: check_store(quotas, stored_usage(services.db, owner), new_bytes=declared_bytes))


def commit_within_quota(services: ApiServices, owner: str | None, upload: FileUpload, commit: Callable[[], T]) -> T:
    """``commit()`` the upload if the owner's files and bytes allow it; else abort it, 429."""
    quotas = Quotas.from_settings(services.settings)

    def checked() -> T:
        try:
            check_store(quotas, stored_usage(services.db, owner), new_bytes=upload.bytes)
        except QuotaExceeded:
            upload.abort()
            raise
        return commit()

    return _holding(owner, checked)


def create_within_quota(services: ApiServices, owner: str | None, scan: BatchScan, create: Callable[[], T]) -> T:
    """``create()`` the batch of ``scan``'s lines if the owner's quotas allow it; else 429."""
    settings = services.settings
    quotas = Quotas.from_settings(settings)

    def checked() -> T:
        work = queued_work(services.db, owner, settings.default_max_tokens)
        check_batch(quotas, work, scan, settings.default_max_tokens)
        return create()

    return _holding(owner, checked)


def declared_length(request: Request) -> int:
    """The body's declared ``Content-Length`` less a multipart envelope's worth (0 if none):
    a lower bound of the file's size, to refuse an upload that cannot fit before reading it."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return 0
    return max(0, int(declared) - MULTIPART_OVERHEAD)
