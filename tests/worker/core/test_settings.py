"""Settings: embedded defaults under CONVEYOR_HOME, env overrides, and no leaked secrets."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from conveyor.worker.core.settings import Settings, redact_url


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)


def test_embedded_defaults_live_under_home(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    s = Settings()
    home = (tmp_path / "home").resolve()
    assert s.is_embedded
    assert s.database == f"sqlite:///{home / 'conveyor.db'}"
    assert s.broker == f"sqla+sqlite:///{home / 'broker.db'}"
    assert s.storage == (home / "objects").as_uri()
    assert not home.exists()
    assert s.ensure_home() == home and home.is_dir()


def test_default_home_is_dot_conveyor(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Settings().home_dir == (tmp_path / ".conveyor").resolve()


def test_production_urls_and_limits_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", "postgresql://app:hunter2@db:5432/conveyor")
    monkeypatch.setenv("CONVEYOR_BROKER_URL", "redis://:hunter2@redis:6379/0")
    monkeypatch.setenv("CONVEYOR_STORAGE_URL", "s3://bucket/prefix")
    monkeypatch.setenv("CONVEYOR_MAX_LINE_BYTES", "4096")
    monkeypatch.setenv("CONVEYOR_SHARD_SIZE", "32")
    monkeypatch.setenv("CONVEYOR_METRICS_TOKEN", "scrape-token-0123456789")
    monkeypatch.setenv("CONVEYOR_UNOWNED_CACHE_SALT", "salt-sesame")
    s = Settings()
    assert not s.is_embedded
    assert s.database == "postgresql://app:hunter2@db:5432/conveyor"
    assert s.storage == "s3://bucket/prefix" and s.shard_size == 32
    assert s.input_limits().max_line_bytes == 4096
    shown = repr(s) + str(s) + repr(s.safe_dict())
    assert "hunter2" not in shown and "scrape-token" not in shown and "sesame" not in shown
    assert s.metrics_token == "scrape-token-0123456789"
    assert "postgresql://app:***@db:5432/conveyor" in shown and "redis://:***@redis:6379/0" in shown


def test_inconsistent_settings_are_refused_naming_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_SHARD_SIZE", "20000")
    with pytest.raises(ValidationError, match="CONVEYOR_SHARD_SIZE=20000 exceeds CONVEYOR_MAX_SHARD_SIZE"):
        Settings()
    monkeypatch.delenv("CONVEYOR_SHARD_SIZE")
    monkeypatch.setenv("CONVEYOR_HEARTBEAT_SECONDS", "40")
    with pytest.raises(ValidationError, match="CONVEYOR_HEARTBEAT_SECONDS"):
        Settings()
    monkeypatch.delenv("CONVEYOR_HEARTBEAT_SECONDS")
    monkeypatch.setenv("CONVEYOR_MAX_LINES_PER_JOB", "0")
    with pytest.raises(ValidationError, match="max_lines_per_job"):
        Settings()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg://u:p@h:5432/db", "postgresql+psycopg://u:***@h:5432/db"),
        ("amqp://guest:guest@localhost:5672//", "amqp://guest:***@localhost:5672//"),
        ("redis://:secret@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
        ("sqs://h?aws_secret_access_key=abc&region=eu", "sqs://h?aws_secret_access_key=***&region=eu"),
        ("https://b.s3/x?X-Amz-Signature=abc", "https://b.s3/x?X-Amz-Signature=***"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_the_embedded_home_is_its_users_only(tmp_path) -> None:
    from conveyor.worker.store.database import create_db_engine

    s = Settings(home=tmp_path / "home")
    assert (s.ensure_home().stat().st_mode & 0o777) == 0o700
    # Whoever creates it first: the embedded database's directory is made the same way.
    other = Settings(home=tmp_path / "other")
    create_db_engine(other.database).dispose()
    assert ((tmp_path / "other").stat().st_mode & 0o777) == 0o700
