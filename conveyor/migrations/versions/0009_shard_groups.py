"""shards grouped by shared prefix: a shard is a set of lines

A job may now be cut by shared prompt prefix (``conveyor.worker.jobs.shard_cut``): ``jobs.shard_order``
says how (NULL: input order, as every job before), ``jobs.prefix_estimate`` holds the intake's
estimate of the shared prefix, and ``shards.group_key`` the prefix a shard's lines share, which
a worker's next turn prefers (found through ``ix_shards_group_status``). A grouped shard's
``first_line``/``last_line`` are its smallest and largest lines; its results are merged by line.

Revision ID: 0009_shard_groups
Revises: 0008_job_request_options
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0009_shard_groups"
down_revision: str | None = "0008_job_request_options"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("shard_order", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("prefix_estimate", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("group_key", sa.String(length=32), nullable=True))
    op.create_index("ix_shards_group_status", "shards", ["group_key", "status"])


def downgrade() -> None:
    op.drop_index("ix_shards_group_status", table_name="shards")
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("group_key")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prefix_estimate")
        batch.drop_column("shard_order")
