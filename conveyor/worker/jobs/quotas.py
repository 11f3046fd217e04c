"""Quotas per owner (an API key): unfinished batches, the lines and output tokens they hold,
and the files and bytes an owner keeps in the store.

A batch's lines and tokens are charged from the moment it is created until it ends (whatever
its end), from what its file's upload learnt (``conveyor.worker.batchio.batch_scan``): ``n x
max_tokens`` for each line, the deployment's default ``max_tokens`` for a line naming none.
(A batch whose input file was deleted since is charged its request count and the default.)

``QuotaExceeded`` names the limit (``limit``: ``active_batches``, ``queued_lines``,
``queued_tokens``, ``stored_bytes``, ``files``) with the setting that sets it, the usage and
what was asked; the API answers it 429 as OpenAI answers a rate limit. The checks read the
database and then the caller writes: two requests of one owner at the same moment may both
pass, which is why the API takes each owner's requests one at a time (``OwnerLocks``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from conveyor.worker.batchio.batch_scan import BatchScan
from conveyor.worker.core.settings import Settings
from conveyor.worker.store.models import Job, JobStatus, StoredFile, now

ACTIVE = tuple(s.value for s in JobStatus if not s.terminal)


@dataclass(frozen=True)
class Quotas:
    active_batches: int
    queued_lines: int
    queued_tokens: int
    stored_bytes: int
    files: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Quotas:
        return cls(
            active_batches=settings.quota_active_batches,
            queued_lines=settings.quota_queued_lines,
            queued_tokens=settings.quota_queued_tokens,
            stored_bytes=settings.quota_stored_bytes,
            files=settings.quota_files,
        )


@dataclass(frozen=True)
class QueuedWork:
    """What an owner's unfinished batches hold."""

    batches: int = 0
    lines: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class StoredUsage:
    files: int = 0
    bytes: int = 0


class QuotaExceeded(Exception):
    """One of an owner's quotas would be passed; ``limit`` names it."""

    def __init__(self, limit: str, quota: int, used: int, requested: int, what: str) -> None:
        self.limit, self.quota, self.used, self.requested = limit, quota, used, requested
        setting = f"CONVEYOR_QUOTA_{limit.upper()}"
        super().__init__(
            f"Quota exceeded for {what} ({limit}): limit {quota}, used {used}, requested {requested} "
            f"({setting}). Wait for your batches to finish, or cancel or delete some, then retry."
        )


def queued_work(db: Engine, owner: str | None, default_max_tokens: int) -> QueuedWork:
    """The batches of ``owner`` that have not ended, and their lines and output tokens."""
    stmt = (
        select(Job.total_requests, StoredFile.meta)
        .select_from(Job)
        .outerjoin(StoredFile, StoredFile.id == Job.input_file_id)
        .where(_job_owner(owner), Job.status.in_(ACTIVE))
    )
    batches = lines = tokens = 0
    with db.connect() as conn:
        for total, meta in conn.execute(stmt):
            scan = _scan(meta)
            batches += 1
            if scan is None:
                lines += total or 0
                tokens += (total or 0) * default_max_tokens
            else:
                lines += scan.lines
                tokens += scan.output_tokens(default_max_tokens)
    return QueuedWork(batches, lines, tokens)


def stored_usage(db: Engine, owner: str | None) -> StoredUsage:
    """The files ``owner`` keeps (not expired) and their bytes."""
    live = (StoredFile.expires_at.is_(None)) | (StoredFile.expires_at > now())
    owned = StoredFile.owner == owner if owner is not None else StoredFile.owner.is_(None)
    with db.connect() as conn:
        count, total = conn.execute(
            select(func.count(), func.coalesce(func.sum(StoredFile.bytes), 0)).where(owned, live)
        ).one()
    return StoredUsage(int(count), int(total))


def check_batch(quotas: Quotas, work: QueuedWork, scan: BatchScan, default_max_tokens: int) -> None:
    """``QuotaExceeded`` if one more batch of ``scan``'s lines would pass a quota."""
    lines, tokens = scan.lines, scan.output_tokens(default_max_tokens)
    if work.batches + 1 > quotas.active_batches:
        raise QuotaExceeded("active_batches", quotas.active_batches, work.batches, 1, "unfinished batches")
    if work.lines + lines > quotas.queued_lines:
        raise QuotaExceeded("queued_lines", quotas.queued_lines, work.lines, lines, "queued request lines")
    if work.tokens + tokens > quotas.queued_tokens:
        raise QuotaExceeded(
            "queued_tokens", quotas.queued_tokens, work.tokens, tokens, "queued output tokens (n x max_tokens)"
        )


def check_store(quotas: Quotas, usage: StoredUsage, *, new_files: int = 1, new_bytes: int = 0) -> None:
    """``QuotaExceeded`` if ``new_files`` more files of ``new_bytes`` would pass a quota."""
    if usage.files + new_files > quotas.files:
        raise QuotaExceeded("files", quotas.files, usage.files, new_files, "stored files")
    if usage.bytes + new_bytes > quotas.stored_bytes:
        raise QuotaExceeded("stored_bytes", quotas.stored_bytes, usage.bytes, new_bytes, "stored bytes")


class OwnerLocks:
    """One lock per owner, so that one owner's quota checks and the writes they allow do not
    interleave within this process (locks of owners no request holds are dropped)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str | None, threading.Lock] = {}
        self._users: dict[str | None, int] = defaultdict(int)

    def acquire(self, owner: str | None) -> None:
        with self._guard:
            lock = self._locks.setdefault(owner, threading.Lock())
            self._users[owner] += 1
        lock.acquire()

    def release(self, owner: str | None) -> None:
        with self._guard:
            self._locks[owner].release()
            self._users[owner] -= 1
            if not self._users[owner]:
                del self._users[owner], self._locks[owner]


def _job_owner(owner: str | None):
    return Job.owner == owner if owner is not None else Job.owner.is_(None)


def _scan(meta: object) -> BatchScan | None:
    if isinstance(meta, dict) and isinstance(meta.get("batch"), dict):
        return BatchScan.from_meta(meta["batch"])
    return None
