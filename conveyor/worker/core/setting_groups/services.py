"""The settings that say where Conveyor keeps its state."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class ServiceSettings(BaseModel):
    """Home and services.

    Where Conveyor keeps its state. A service left unset is the embedded default under ``home``
    (the resolved locations below).
    """

    # Where the embedded database, broker, objects and model cache live when no server is named.
    home: Path = Field(default_factory=lambda: Path("~/.conveyor"))

    # The SQLAlchemy URL of the database (PostgreSQL in production); unset: SQLite under home.
    database_url: str | None = None
    # The Celery broker URL (redis://, amqp://, sqs://); unset: kombu's SQLAlchemy transport on SQLite.
    broker_url: str | None = None
    # The object store: s3://bucket/prefix on any S3-compatible store; unset: a directory under home.
    storage_url: str | None = None
    # The S3 endpoint for a non-AWS store; unset: boto3 reads AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL itself.
    storage_endpoint_url: str | None = None

    # ---- resolved locations -------------------------------------------------------------

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def database(self) -> str:
        """The SQLAlchemy URL of the database (embedded: SQLite file under home)."""
        return self.database_url or f"sqlite:///{self.home_dir / 'conveyor.db'}"

    @property
    def broker(self) -> str:
        """The Celery broker URL (embedded: kombu's SQLAlchemy transport on SQLite)."""
        return self.broker_url or f"sqla+sqlite:///{self.home_dir / 'broker.db'}"

    @property
    def storage(self) -> str:
        """The object store URL: ``s3://bucket/prefix`` or ``file:///dir`` (embedded)."""
        return self.storage_url or (self.home_dir / "objects").as_uri()

    @property
    def is_embedded(self) -> bool:
        return not (self.database_url or self.broker_url or self.storage_url)

    def ensure_home(self) -> Path:
        """Create the home directory (for the embedded defaults), readable by its user only
        (it holds the database with every prompt and key hash); returns it."""
        home = self.home_dir
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        return home
