"""One owner's quota checks and the writes they allow, one at a time across every process on
the database (every API replica).

``take_owner_turn(conn, owner)`` upserts the owner's ``owner_quota_locks`` row as the first
statement of the caller's transaction, which holds the row until that transaction ends: on
PostgreSQL a second replica's upsert waits on the row lock (or on the first one's insert of
it) and its check, a later statement under READ COMMITTED, reads what the first committed;
on SQLite the write takes the database's write lock, which serialises the same. The check and
the write it allows must follow on ``conn``, in the same transaction.
"""

from __future__ import annotations

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from conveyor.worker.store.models import OwnerQuotaLock, now


def take_owner_turn(conn: Connection, owner: str | None) -> None:
    """Lock ``owner``'s quota row (``None``: the owner-less, as ``""``) until ``conn``'s
    transaction ends."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(OwnerQuotaLock).values(owner=owner or "", locked_at=now())
    conn.execute(stmt.on_conflict_do_update(index_elements=["owner"], set_={"locked_at": stmt.excluded.locked_at}))
