"""workers registry, jobs.expired_at

Revision ID: 0003_workers_and_expiry
Revises: 0002
Create Date: 2025-03-01

``workers``: each worker process records the model it serves and a heartbeat, so that
``submit`` can warn and ``status`` can say when no live worker serves a job's model.
``jobs.expired_at``: when a job passed its completion window (OpenAI's ``expired`` status).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_workers_and_expiry"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("hostname", sa.String(length=256), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("queue", sa.String(length=256), nullable=False),
        sa.Column(
            "state",
            sa.Enum("starting", "ready", "stopped", "failed", name="workerstate", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("heartbeat_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_workers_model_heartbeat", "workers", ["model", "heartbeat_at"], unique=False)
    op.add_column("jobs", sa.Column("expired_at", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "expired_at")
    op.drop_index("ix_workers_model_heartbeat", table_name="workers")
    op.drop_table("workers")
