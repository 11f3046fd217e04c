"""The owner's quotas (``conveyor.worker.jobs.quotas``) at the API's doors, answered 429 as OpenAI
answers a rate limit: ``code`` ``rate_limit_exceeded``, ``param`` the limit's name, and a
message giving the limit, the usage and what was asked (the ``openai`` SDK raises
``RateLimitError``).

Files: before the body is read (the files count, and the bytes already stored plus the
declared length), then again before the upload is recorded, with its real size (nothing is
kept past a quota). Batches: before the job is recorded, with the file's lines and tokens.
The check and the write it allows run in one transaction holding the owner's turn in the
database, so API replicas take one owner's requests one at a time; within this app they
queue first on the app's ``OwnerLocks``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.engine import Connection
from starlette.requests import Request

from conveyor.worker.api.errors import ApiError
from conveyor.worker.api.services import ApiServices
from conveyor.worker.api.uploads import MULTIPART_OVERHEAD
from conveyor.worker.jobs.files import FileUpload
from conveyor.worker.jobs.quotas import (
    Charge,
    QuotaExceeded,
    Quotas,
    check_batch_turn,
    check_store,
    check_store_turn,
    stored_usage,
)

T = TypeVar("T")

RATE_LIMITED = "rate_limit_exceeded"

# A check to run in the transaction that writes what it allows (``create_job``'s, ``commit``'s).
Check = Callable[[Connection], None]


def quota_error(exc: QuotaExceeded) -> ApiError:
    return ApiError(429, str(exc), param=exc.limit, code=RATE_LIMITED)


def _holding(services: ApiServices, owner: str | None, fn: Callable[[], T]) -> T:
    services.owner_locks.acquire(owner)
    try:
        return fn()
    except QuotaExceeded as exc:
        raise quota_error(exc) from None
    finally:
        services.owner_locks.release(owner)


def check_upload_start(services: ApiServices, owner: str | None, declared_bytes: int) -> None:
    """429 if one more file (of at least ``declared_bytes``) would pass the owner's quotas: an
    early answer before the body is read (the binding check comes with the commit)."""
    quotas = Quotas.from_settings(services.settings)

    def check() -> None:
        with services.db.connect() as conn:
            check_store(quotas, stored_usage(conn, owner), new_bytes=declared_bytes)

    _holding(services, owner, check)


def commit_within_quota(
    services: ApiServices, owner: str | None, upload: FileUpload, commit: Callable[[Check], T]
) -> T:
    """``commit(check)`` the upload, ``check`` refusing it (nothing kept) past the owner's
    files and bytes; 429 then."""
    quotas = Quotas.from_settings(services.settings)

    def check(conn: Connection) -> None:
        check_store_turn(conn, owner, quotas, upload.bytes)

    return _holding(services, owner, lambda: commit(check))


def create_within_quota(services: ApiServices, owner: str | None, charge: Charge, create: Callable[[Check], T]) -> T:
    """``create(check)`` the batch of ``charge``, ``check`` refusing it past the owner's quotas; 429 then."""
    quotas = Quotas.from_settings(services.settings)
    default_max_tokens = services.settings.default_max_tokens

    def check(conn: Connection) -> None:
        check_batch_turn(conn, owner, quotas, charge, default_max_tokens)

    return _holding(services, owner, lambda: create(check))


def declared_length(request: Request) -> int:
    """The body's declared ``Content-Length`` less a multipart envelope's worth (0 if none):
    a lower bound of the file's size, to refuse an upload that cannot fit before reading it."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return 0
    return max(0, int(declared) - MULTIPART_OVERHEAD)
