"""Database engines and sessions: one place that knows how to connect to SQLite and Postgres."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import create_engine as _sa_create_engine
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker


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
            Path(u.database).expanduser().parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # its user's only
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
