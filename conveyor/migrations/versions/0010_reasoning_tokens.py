"""items and jobs: reasoning tokens

A reasoning model's thinking tokens, counted per item (they are part of its
``completion_tokens``) and summed on the job at finalisation, for the batch's
``usage.output_tokens_details.reasoning_tokens``. Rows written before are 0.

Revision ID: 0010_reasoning_tokens
Revises: 0009_shard_groups
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_reasoning_tokens"
down_revision: str | None = "0009_shard_groups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("reasoning_tokens", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("reasoning_tokens", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("reasoning_tokens")
    with op.batch_alter_table("items") as batch:
        batch.drop_column("reasoning_tokens")
