"""webhook_endpoints, webhook_events (the outbox of job ends), webhook_deliveries

Revision ID: 0013_webhooks
Revises: 0012_job_charge
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0013_webhooks"
down_revision: str | None = "0012_job_charge"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("event_types", JSONType, nullable=False),
        sa.Column("secret", sa.String(128), nullable=False),
        sa.Column("previous_secret", sa.String(128), nullable=True),
        sa.Column("previous_secret_until", sa.Double(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
    )
    op.create_index("ix_webhook_endpoints_owner_created", "webhook_endpoints", ["owner", "created_at"])
    op.create_table(
        "webhook_events",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("payload", JSONType, nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("fanned_out_at", sa.Double(), nullable=True),
        sa.UniqueConstraint("job_id", "type", name="uq_webhook_events_job_type"),
    )
    op.create_index("ix_webhook_events_fanned_created", "webhook_events", ["fanned_out_at", "created_at"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", BigIntPK, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(64), sa.ForeignKey("webhook_events.id", ondelete="CASCADE"), nullable=False),
        sa.Column("endpoint_id", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.Double(), nullable=False),
        sa.Column("lease_until", sa.Double(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.UniqueConstraint("event_id", "endpoint_id", name="uq_webhook_deliveries_event_endpoint"),
    )
    op.create_index("ix_webhook_deliveries_status_next", "webhook_deliveries", ["status", "next_attempt_at"])
    op.create_index("ix_webhook_deliveries_updated", "webhook_deliveries", ["updated_at"])


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_events")
    op.drop_table("webhook_endpoints")
