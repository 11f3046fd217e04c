"""jobs: request options (chat, system prompt, sampling defaults) and the model as submitted

A job's options apply to every line of its input; they are read where the input is ingested,
which for a broker or API submission is a later task on a worker, so the job row keeps them.
``model_name`` is the model as the job named it, for the results' ``model`` field (``model``
stays canonical: a local directory's absolute path).

Revision ID: 0008_job_request_options
Revises: 0007_jobs_expiry_index
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0008_job_request_options"
down_revision: str | None = "0007_jobs_expiry_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("request_options", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))
        batch.add_column(sa.Column("model_name", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("model_name")
        batch.drop_column("request_options")
