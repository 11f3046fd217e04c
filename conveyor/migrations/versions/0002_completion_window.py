"""jobs: completion window and expiry, an endpoint on every job

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01

A job's batch object must validate as OpenAI's: ``completion_window`` (stored per job,
default ``24h``) and ``expires_at`` (created_at + window, ready for whatever moves a job
past it to ``expired``). Jobs stored before get the 24 h window and its expiry. Their
``endpoint`` was left NULL when their lines mixed endpoints (or none was valid); they get
``/v1/chat/completions``, which new jobs report when no line names one.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("completion_window", sa.String(length=16), server_default="24h", nullable=False))
    op.add_column("jobs", sa.Column("expires_at", sa.Double(), nullable=True))
    op.execute("UPDATE jobs SET expires_at = created_at + 86400 WHERE expires_at IS NULL")
    op.execute("UPDATE jobs SET endpoint = '/v1/chat/completions' WHERE endpoint IS NULL")


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite 3.35+): a batch table copy would drop `jobs`,
    # and with foreign keys on that deletes every shard and item by cascade.
    op.drop_column("jobs", "expires_at")
    op.drop_column("jobs", "completion_window")
