"""shards: their stored items by status

Counted when a shard is released, so that the job's running request counts are a sum over
its shards instead of a count over all its items at every release (quadratic in the job's
size). Shards written before are 0 until released again; finalisation recounts the job.

Revision ID: 0011_shard_item_counts
Revises: 0010_reasoning_tokens
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_shard_item_counts"
down_revision: str | None = "0010_reasoning_tokens"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("succeeded_items", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("failed_items", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("failed_items")
        batch.drop_column("succeeded_items")
