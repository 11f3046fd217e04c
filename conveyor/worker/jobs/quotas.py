"""Quotas per owner (an API key): unfinished batches, the lines and output tokens they hold,
and the files and bytes an owner keeps in the store.

A batch is charged its lines and tokens from the moment it is created until it ends (whatever
its end): its ``Charge`` is stored on the job (``jobs.charged_lines``, ``charged_tokens``) when
it is created, from what its file's upload learnt (``conveyor.worker.batchio.batch_scan``):
``n x max_tokens`` for each line, the deployment's default ``max_tokens`` for a line naming
none or holding no request body. Deleting the input file afterwards changes nothing. A job
created otherwise (the CLI, the broker) is charged what its intake counted; until then, and
for jobs from before charges were stored, its ``total_requests`` lines at the default.

``QuotaExceeded`` names the limit (``limit``: ``active_batches``, ``queued_lines``,
``queued_tokens``, ``stored_bytes``, ``files``) with the setting that sets it, the usage and
what was asked; the API answers it 429 as OpenAI answers a rate limit. A check reads the
database and the caller then writes: both run in one transaction that first takes the owner's
turn (``conveyor.worker.store.owner_turns``), so two requests of one owner, on one API replica
or two, never both pass one check. ``OwnerLocks`` queues one owner's requests within a
process first, so that they wait without holding a database connection each.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from conveyor.worker.batchio.batch_scan import BatchScan
from conveyor.worker.core.settings import Settings
from conveyor.worker.store.models import Job, JobStatus, StoredFile, now
from conveyor.worker.store.owner_turns import take_owner_turn

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


@dataclass(frozen=True)
class Charge:
    """What one batch holds of its owner's quotas until it ends."""

    lines: int
    tokens: int  # n x max_tokens over its lines

    @classmethod
    def of_scan(cls, scan: BatchScan, default_max_tokens: int) -> Charge:
        return cls(scan.lines, scan.output_tokens(default_max_tokens))


def queued_work(conn: Connection, owner: str | None, default_max_tokens: int) -> QueuedWork:
    """The batches of ``owner`` that have not ended, and the lines and output tokens charged
    to them (a job not charged yet: its ``total_requests`` at ``default_max_tokens``)."""
    total = func.coalesce(Job.total_requests, 0)
    stmt = select(
        func.count(),
        func.coalesce(func.sum(func.coalesce(Job.charged_lines, total)), 0),
        func.coalesce(func.sum(func.coalesce(Job.charged_tokens, total * default_max_tokens)), 0),
    ).where(_job_owner(owner), Job.status.in_(ACTIVE))
    batches, lines, tokens = conn.execute(stmt).one()
    return QueuedWork(int(batches), int(lines), int(tokens))


def stored_usage(conn: Connection, owner: str | None) -> StoredUsage:
    """The files ``owner`` keeps (not expired) and their bytes."""
    live = (StoredFile.expires_at.is_(None)) | (StoredFile.expires_at > now())
    owned = StoredFile.owner == owner if owner is not None else StoredFile.owner.is_(None)
    count, total = conn.execute(
        select(func.count(), func.coalesce(func.sum(StoredFile.bytes), 0)).where(owned, live)
    ).one()
    return StoredUsage(int(count), int(total))


def check_batch(quotas: Quotas, work: QueuedWork, charge: Charge) -> None:
    """``QuotaExceeded`` if one more batch of ``charge`` would pass a quota."""
    lines, tokens = charge.lines, charge.tokens
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


def check_batch_turn(
    conn: Connection, owner: str | None, quotas: Quotas, charge: Charge, default_max_tokens: int
) -> None:
    """In ``conn``'s transaction, before the job is written on it: the owner's turn, then
    ``QuotaExceeded`` if one more batch of ``charge`` would pass a quota."""
    take_owner_turn(conn, owner)
    check_batch(quotas, queued_work(conn, owner, default_max_tokens), charge)


def check_store_turn(conn: Connection, owner: str | None, quotas: Quotas, new_bytes: int) -> None:
    """In ``conn``'s transaction, before the file is written on it: the owner's turn, then
    ``QuotaExceeded`` if one more file of ``new_bytes`` would pass a quota."""
    take_owner_turn(conn, owner)
    check_store(quotas, stored_usage(conn, owner), new_bytes=new_bytes)


class OwnerLocks:
    """One lock per owner, so that one owner's requests to a process wait for their turn here,
    each without holding a database connection, before they take it in the database
    (``check_batch_turn``); locks of owners no request holds are dropped."""

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
