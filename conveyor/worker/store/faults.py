"""Which errors mean a dependency is down, rather than that the work itself is wrong.

A database that refuses or drops connections, or an object store that cannot be reached or
answers 5xx, is no item's fault: the caller should wait for it to come back and try again,
without counting an attempt against the shard or its items. ``dependency_of(exc)`` names the
dependency that is down (``DATABASE`` or ``STORAGE``), or returns None for every other
error, which stays the work's own.
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc

from conveyor.worker.store.objects.base import StorageUnavailable

DATABASE = "database"
STORAGE = "storage"

# SQLite raises OperationalError for a busy or unreachable file, and also for a schema
# mistake ("no such table"); only these messages are the database being unavailable.
_SQLITE_UNAVAILABLE = ("locked", "busy", "unable to open", "disk i/o")


def _database_unavailable(exc: sa_exc.DBAPIError) -> bool:
    if exc.connection_invalidated:
        return True
    if not isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
        return False
    if type(exc.orig).__module__.startswith("sqlite3"):
        message = str(exc.orig).lower()
        return any(part in message for part in _SQLITE_UNAVAILABLE)
    return True  # Postgres: refused, closed, reset, timed out, or a transient server state


def _direct(exc: BaseException) -> str | None:
    if isinstance(exc, StorageUnavailable):
        return STORAGE if exc.transient else None  # a wrong bucket needs a person, not time
    if isinstance(exc, (sa_exc.DisconnectionError, sa_exc.TimeoutError)):  # TimeoutError: the pool's
        return DATABASE
    if isinstance(exc, sa_exc.DBAPIError) and _database_unavailable(exc):
        return DATABASE
    return None


def dependency_of(exc: BaseException) -> str | None:
    """``DATABASE`` or ``STORAGE`` if ``exc`` (or an exception it was raised from) says that
    dependency is unreachable for now; None if the error is the work's own."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _direct(current)
        if found is not None:
            return found
        current = current.__cause__
    return None
