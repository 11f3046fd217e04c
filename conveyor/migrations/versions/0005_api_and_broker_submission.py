"""the HTTP API and broker-level submission: api_keys, files, job owners and file ids,
idempotency keys and completion announcements, workers' checkpoints

``api_keys`` holds a SHA-256 of each key; ``files`` the OpenAI Files API objects. A job gets
its owner (the key that created it), the ids of its input, output and error files, the
idempotency key of a broker-level submission (unique: a redelivered message finds the same
job), and where to announce its end (``notify``, published once: ``notified_at``). A worker
records the checkpoint it loaded when it serves it under a public name.

Revision ID: 0005_api_and_broker_submission
Revises: 0004_crash_isolation
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005_api_and_broker_submission"
down_revision: str | None = "0004_crash_isolation"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.Column("last_used_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("key_hash"),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=True),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("uri", sa.String(length=2048), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_details", sa.Text(), nullable=True),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("metadata", JSONType, nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_files_owner_created", "files", ["owner", "created_at"], unique=False)
    op.create_index("ix_files_job", "files", ["job_id"], unique=False)
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("input_file_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("output_file_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("error_file_id", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("idempotency_key", sa.String(length=256), nullable=True))
        batch.add_column(sa.Column("notify", JSONType, nullable=True))
        batch.add_column(sa.Column("notified_at", sa.Double(), nullable=True))
        batch.create_unique_constraint("uq_jobs_idempotency_key", ["idempotency_key"])
        batch.create_index("ix_jobs_owner_created", ["owner", "created_at"], unique=False)
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("checkpoint", sa.String(length=2048), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("checkpoint")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_owner_created")
        batch.drop_constraint("uq_jobs_idempotency_key", type_="unique")
        for column in (
            "notified_at",
            "notify",
            "idempotency_key",
            "error_file_id",
            "output_file_id",
            "input_file_id",
            "owner",
        ):
            batch.drop_column(column)
    op.drop_index("ix_files_job", table_name="files")
    op.drop_index("ix_files_owner_created", table_name="files")
    op.drop_table("files")
    op.drop_table("api_keys")
