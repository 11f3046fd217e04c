"""Migrations build exactly the models' schema, and a worker refuses a wrong revision."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Base
from conveyor.worker.store.schema import SchemaError, check_schema, current_revision, head_revision, upgrade_database
from tests.worker.helpers import REPO


def test_upgrade_creates_every_table_and_matches_the_models(db_url: str) -> None:
    assert upgrade_database(db_url) == head_revision()
    engine = create_db_engine(db_url)
    try:
        assert set(Base.metadata.tables) <= set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            assert compare_metadata(ctx, Base.metadata) == []
        assert check_schema(engine) == head_revision()
    finally:
        engine.dispose()


def test_upgrade_is_idempotent(db_url: str) -> None:
    upgrade_database(db_url)
    assert upgrade_database(db_url) == head_revision()


def test_check_schema_on_an_empty_database_says_run_db_upgrade(db_url: str) -> None:
    engine = create_db_engine(db_url)
    try:
        assert current_revision(engine) is None
        with pytest.raises(SchemaError, match="run `conveyor db upgrade`"):
            check_schema(engine)
    finally:
        engine.dispose()


def test_check_schema_rejects_a_revision_from_newer_code(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade_database(url)
    engine = create_db_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'ffffffffffff'"))
        with pytest.raises(SchemaError, match="newer conveyor"):
            check_schema(engine)
    finally:
        engine.dispose()


def test_schema_error_never_shows_the_password(pg_url: str) -> None:
    engine = create_db_engine(pg_url.replace("@", ":s3cret@", 1))  # trust auth ignores it
    try:
        with pytest.raises(SchemaError) as info:
            check_schema(engine)
        assert "s3cret" not in str(info.value) and "***" in str(info.value)
    finally:
        engine.dispose()


def test_upgrading_keeps_old_jobs_valid_batch_objects(db_url: str) -> None:
    """Jobs stored before completion windows (revision 0001) get the 24h window OpenAI's
    batches had, its expiry, and an endpoint (mixed-endpoint jobs stored none)."""
    assert upgrade_database(db_url, "0001") == "0001"
    engine = create_db_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, status, model, priority, endpoint, shard_size, num_shards,"
                    " total_requests, completed_requests, failed_requests, invalid_requests, prompt_tokens,"
                    " cached_tokens, completion_tokens, created_at, updated_at) VALUES"
                    " ('batch_old', 'completed', 'm', 0, NULL, 4, 0, 0, 0, 0, 0, 0, 0, 0, 1000.5, 1000.5)"
                )
            )
        assert upgrade_database(db_url) == head_revision()
        with engine.connect() as conn:
            row = conn.execute(text("SELECT completion_window, expires_at, endpoint FROM jobs")).one()
        assert tuple(row) == ("24h", 1000.5 + 86400, "/v1/chat/completions")
    finally:
        engine.dispose()


def test_processes_starting_at_once_on_a_fresh_home_migrate_it_once(tmp_path) -> None:
    """A worker and a submit started together on the embedded defaults both migrate the new
    SQLite file: one at a time, so neither trips over the other's tables."""
    home = tmp_path / "home"
    start = time.time() + 8  # all four imported by then: they migrate at the same moment
    code = (
        "import time; from conveyor.worker.core.settings import Settings\n"
        "from conveyor.worker.entrypoints.client import Client\n"
        f"time.sleep(max(0.0, {start} - time.time())); Client(Settings(home={str(home)!r})).db"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True) for _ in range(4)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    engine = create_db_engine(f"sqlite:///{home / 'conveyor.db'}")
    try:
        assert check_schema(engine) == head_revision()
    finally:
        engine.dispose()
