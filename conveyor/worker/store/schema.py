"""Schema versions: apply the Alembic migrations in ``conveyor/migrations/`` and check a database.

``upgrade_database(url)`` is what ``conveyor db upgrade`` runs; ``check_schema(engine)`` is
what a worker runs at start, refusing an outdated schema with a message saying what to do.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Connection, Engine

from conveyor.worker.core.file_lock import file_lock
from conveyor.worker.core.settings import Settings, redact_url
from conveyor.worker.store.database import create_db_engine, normalize_url

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaError(RuntimeError):
    """The database's schema is missing, older or newer than this code expects."""


def alembic_config(url: str | URL | None = None, connection: Connection | None = None) -> Config:
    """A programmatic Alembic config for ``conveyor/migrations/`` (no alembic.ini needed)."""
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise SchemaError(f"migrations not found at {MIGRATIONS_DIR}: this conveyor install is incomplete")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.attributes["url"] = str(url) if isinstance(url, str) else url.render_as_string(hide_password=False)
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision in ``conveyor/migrations/versions``."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise SchemaError(f"no migrations in {MIGRATIONS_DIR / 'versions'}")
    return head


def current_revision(bind: Engine | Connection) -> str | None:
    """The database's Alembic revision, or None when it was never migrated."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return current_revision(conn)
    heads = MigrationContext.configure(bind).get_current_heads()
    if len(heads) > 1:
        raise SchemaError(f"the database has several schema revisions ({', '.join(heads)}); repair alembic_version")
    return heads[0] if heads else None


def upgrade_database(url: str | URL, revision: str = "head") -> str:
    """Migrate the database at ``url`` to ``revision``; returns the revision it is at now."""
    command.upgrade(alembic_config(normalize_url(url)), revision)
    engine = create_db_engine(url)
    try:
        return current_revision(engine) or "base"
    finally:
        engine.dispose()


def check_schema(engine: Engine) -> str:
    """Raise ``SchemaError`` unless the database is at the head revision; returns it."""
    where = redact_url(engine.url.render_as_string(hide_password=False))
    head = head_revision()
    current = current_revision(engine)
    if current == head:
        return head
    if current is None:
        raise SchemaError(
            f"the database {where} has no conveyor schema yet (this code needs revision {head}); "
            "run `conveyor db upgrade` first"
        )
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current in known:
        raise SchemaError(
            f"the database {where} is at schema revision {current} but this code needs {head}; "
            "run `conveyor db upgrade`"
        )
    raise SchemaError(
        f"the database {where} is at schema revision {current}, which this code does not know "
        f"(its newest is {head}): it was migrated by a newer conveyor; upgrade conveyor"
    )


def ensure_schema(settings: Settings, engine: Engine) -> str:
    """The one rule for a database about to be used: the embedded SQLite is ours, so migrate
    it; any other database is only checked (``conveyor db upgrade`` migrates it), never
    migrated behind its operator's back. Returns the revision it is at."""
    if settings.database_url is None:
        # Two processes starting at once (a worker and a submit) would both create the tables
        # (SQLite runs DDL outside a transaction): one migrates at a time, the other then finds
        # the schema at head.
        with file_lock(settings.ensure_home() / "schema.lock"):
            return upgrade_database(engine.url)
    return check_schema(engine)
