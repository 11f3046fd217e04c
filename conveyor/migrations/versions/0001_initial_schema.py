"""initial schema

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "engine_snapshots",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("worker_id", sa.String(length=256), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("running", sa.Integer(), nullable=False),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("kv_usage", sa.Double(), nullable=False),
        sa.Column("prefix_hit_rate", sa.Double(), nullable=False),
        sa.Column("tokens_per_s", sa.Double(), nullable=False),
        sa.Column("prompt_tokens_per_s", sa.Double(), nullable=False),
        sa.Column("preemptions", sa.BigInteger(), nullable=False),
        sa.Column(
            "extra", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=True
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_engine_snapshots_time", "engine_snapshots", ["created_at"], unique=False)
    op.create_index("ix_engine_snapshots_worker_time", "engine_snapshots", ["worker_id", "created_at"], unique=False)
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "validating",
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "cancelling",
                "cancelled",
                name="jobstatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=True),
        sa.Column("input_format", sa.String(length=16), nullable=True),
        sa.Column("shard_size", sa.Integer(), nullable=False),
        sa.Column("num_shards", sa.Integer(), nullable=False),
        sa.Column("input_uri", sa.String(length=2048), nullable=True),
        sa.Column("output_uri", sa.String(length=2048), nullable=True),
        sa.Column("error_uri", sa.String(length=2048), nullable=True),
        sa.Column("total_requests", sa.Integer(), nullable=False),
        sa.Column("completed_requests", sa.Integer(), nullable=False),
        sa.Column("failed_requests", sa.Integer(), nullable=False),
        sa.Column("invalid_requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column(
            "metrics", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=True
        ),
        sa.Column(
            "errors", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=True
        ),
        sa.Column(
            "metadata", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=True
        ),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("in_progress_at", sa.Double(), nullable=True),
        sa.Column("finalizing_at", sa.Double(), nullable=True),
        sa.Column("completed_at", sa.Double(), nullable=True),
        sa.Column("failed_at", sa.Double(), nullable=True),
        sa.Column("cancelling_at", sa.Double(), nullable=True),
        sa.Column("cancelled_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_jobs_status_created", "jobs", ["status", "created_at"], unique=False)
    op.create_table(
        "items",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column(
            "status", sa.Enum("succeeded", "failed", name="itemstatus", native_enum=False, length=16), nullable=False
        ),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=True),
        sa.Column(
            "response", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=True
        ),
        sa.Column(
            "error", sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"), nullable=True
        ),
        sa.Column("finish_reason", sa.String(length=16), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.Column("queue_time", sa.Double(), nullable=True),
        sa.Column("ttft", sa.Double(), nullable=True),
        sa.Column("tpot", sa.Double(), nullable=True),
        sa.Column("e2e", sa.Double(), nullable=True),
        sa.Column("worker_id", sa.String(length=256), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "custom_id"),
    )
    op.create_index("ix_items_job_line", "items", ["job_id", "line"], unique=False)
    op.create_index("ix_items_job_shard", "items", ["job_id", "shard_index"], unique=False)
    op.create_table(
        "shards",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("first_line", sa.Integer(), nullable=False),
        sa.Column("last_line", sa.Integer(), nullable=False),
        sa.Column("num_items", sa.Integer(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "pending",
                "running",
                "completed",
                "failed",
                "cancelled",
                name="shardstatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=256), nullable=True),
        sa.Column("lease_expires_at", sa.Double(), nullable=True),
        sa.Column("heartbeat_at", sa.Double(), nullable=True),
        sa.Column("input_uri", sa.String(length=2048), nullable=True),
        sa.Column("output_uri", sa.String(length=2048), nullable=True),
        sa.Column("error_uri", sa.String(length=2048), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "shard_index"),
    )
    op.create_index("ix_shards_status_lease", "shards", ["status", "lease_expires_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_shards_status_lease", table_name="shards")
    op.drop_table("shards")
    op.drop_index("ix_items_job_shard", table_name="items")
    op.drop_index("ix_items_job_line", table_name="items")
    op.drop_table("items")
    op.drop_index("ix_jobs_status_created", table_name="jobs")
    op.drop_table("jobs")
    op.drop_index("ix_engine_snapshots_worker_time", table_name="engine_snapshots")
    op.drop_index("ix_engine_snapshots_time", table_name="engine_snapshots")
    op.drop_table("engine_snapshots")
