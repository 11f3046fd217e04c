"""The webhook outbox's writing side: a job's end recorded as an event in the transaction
that ends it.

Every place that moves a job to ``completed``, ``failed``, ``cancelled`` or ``expired`` calls
``record_job_end`` on the same connection, inside the same transaction: if the state change
commits, so does its event; if the process dies before, neither exists. One event per job and
type (a unique key), with a stable id, ``evt_<hex>``, which every delivery and retry sends as
``webhook-id``. Its payload is OpenAI's: ``{"id", "object": "event", "type", "created_at",
"data": {"id": <batch id>}}``. Deliveries are the dispatcher's (``webhook_dispatch``).
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from conveyor.worker.store.models import Job, JobStatus, WebhookEvent

EVENT_TYPES = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")


def event_type(status: JobStatus) -> str:
    if not status.terminal:
        raise ValueError(f"a job that is {status.value} has not ended: no event")
    return f"batch.{status.value}"


def event_payload(event_id: str, type_: str, created_at: float, job_id: str) -> dict[str, Any]:
    return {"id": event_id, "object": "event", "type": type_, "created_at": int(created_at), "data": {"id": job_id}}


def record_job_end(conn: Connection, job_id: str, status: JobStatus, t: float) -> None:
    """Record that ``job_id`` ended ``status`` at ``t``, in ``conn``'s transaction (the one
    that set the status). A second end of the same type (a retried job failing again) records
    nothing new."""
    type_ = event_type(status)
    owner = conn.execute(select(Job.owner).where(Job.id == job_id)).scalar_one_or_none()
    event_id = f"evt_{uuid.uuid4().hex}"
    values = {
        "id": event_id, "job_id": job_id, "type": type_, "owner": owner, "created_at": t,
        "payload": event_payload(event_id, type_, t, job_id),
    }  # fmt: skip
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    conn.execute(dialect.insert(WebhookEvent).values(**values).on_conflict_do_nothing())
