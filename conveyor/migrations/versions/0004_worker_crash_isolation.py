"""worker deaths and poison items: shard failures/deaths/solo_item, item_crashes

A worker's death no longer counts as a failed attempt of its shard. ``failures`` counts the
attempts that raised in the worker (what CONVEYOR_SHARD_MAX_ATTEMPTS limits), ``deaths`` the
takeovers after a worker died holding the shard, and ``solo_item`` the one item the shard
runs alone right now; ``item_crashes`` counts, per item, the deaths while it ran alone.

Revision ID: 0004_crash_isolation
Revises: 0003_workers_and_expiry
Create Date: 2025-06-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_crash_isolation"
down_revision: str | None = "0003_workers_and_expiry"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("failures", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("deaths", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("solo_item", sa.String(length=512), nullable=True))
    op.create_table(
        "item_crashes",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("crashes", sa.Integer(), nullable=False),
        sa.Column("last_worker", sa.String(length=256), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "custom_id"),
    )
    op.create_index("ix_item_crashes_job_shard", "item_crashes", ["job_id", "shard_index"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_item_crashes_job_shard", table_name="item_crashes")
    op.drop_table("item_crashes")
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("solo_item")
        batch.drop_column("deaths")
        batch.drop_column("failures")
