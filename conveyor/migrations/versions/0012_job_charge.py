"""jobs: the charge against the owner's quotas; owner_quota_locks

A batch's lines and output tokens are stored on it when it is created, so that its charge
holds until it ends whatever becomes of its input file (the quotas summed the input file's
scan before, and a deleted file dropped the charge). Jobs from before are NULL: charged their
``total_requests`` at the default ``max_tokens``, as a batch whose file was gone was.

``owner_quota_locks`` holds a row per owner, locked by each quota check together with the
write it allows, so that API replicas take one owner's requests one at a time.

Revision ID: 0012_job_charge
Revises: 0011_shard_item_counts
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_job_charge"
down_revision: str | None = "0011_shard_item_counts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("charged_lines", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("charged_tokens", sa.BigInteger(), nullable=True))
    op.create_table(
        "owner_quota_locks",
        sa.Column("owner", sa.String(64), primary_key=True),
        sa.Column("locked_at", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("owner_quota_locks")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("charged_tokens")
        batch.drop_column("charged_lines")
