"""Alembic environment for conveyor.

Run programmatically through ``conveyor.worker.store.schema.upgrade_database(url)`` (what
``conveyor db upgrade`` does), or by hand: ``alembic -c conveyor/migrations/alembic.ini upgrade head``
(the URL then comes from ``CONVEYOR_DATABASE_URL`` / the embedded default).

A caller may hand in an open connection as ``config.attributes["connection"]`` (tests do,
to migrate inside a throwaway Postgres schema) or a URL as ``config.attributes["url"]``.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from conveyor.worker.core.settings import Settings
from conveyor.worker.store.database import create_db_engine, normalize_url
from conveyor.worker.store.models import Base

config = context.config
target_metadata = Base.metadata
if config.config_file_name is not None:  # run by hand with alembic.ini: log progress
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.attributes.get("url") or Settings().database
    return normalize_url(url).render_as_string(hide_password=False)


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTER via table copy
        compare_type=True,
    )


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_db_engine(_url(), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
