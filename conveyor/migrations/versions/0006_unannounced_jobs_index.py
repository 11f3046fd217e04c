"""the announcements outbox: a partial index on the jobs with an announcement to publish

A worker looks for finished jobs whose end is still to be announced on the broker
(``notify`` set, ``notified_at`` not yet) every sweep; this index holds only those jobs, so
the look-up reads a handful of rows however many jobs the table keeps.

Revision ID: 0006_unannounced_jobs_index
Revises: 0005_api_and_broker_submission
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_unannounced_jobs_index"
down_revision: str | None = "0005_api_and_broker_submission"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNANNOUNCED = "notify IS NOT NULL AND notified_at IS NULL"


def upgrade() -> None:
    op.create_index(
        "ix_jobs_unannounced",
        "jobs",
        ["updated_at"],
        unique=False,
        postgresql_where=sa.text(UNANNOUNCED),
        sqlite_where=sa.text(UNANNOUNCED),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_unannounced", table_name="jobs")
