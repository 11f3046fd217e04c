"""an index for the expiry sweep: jobs by status and expires_at

Every worker looks, each sweep, for jobs still ``validating`` or ``in_progress`` whose
completion window has passed; without an index that reads every job the table keeps.

Revision ID: 0007_jobs_expiry_index
Revises: 0006_unannounced_jobs_index
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007_jobs_expiry_index"
down_revision: str | None = "0006_unannounced_jobs_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_status_expires", "jobs", ["status", "expires_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_status_expires", table_name="jobs")
