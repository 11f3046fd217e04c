"""Submissions named by an idempotency key (a broker message's): the job a key names, and a
refused submission recorded as a ``failed`` job under its key.

A key names one submission, accepted or refused: a message sent again with the same key
finds the job the first one made (``create_job`` for an accepted one, ``record_refusal`` for
a refused one) and makes no other. A refused submission is kept as a job so that it can be
announced to the producer like any job's end (``conveyor.worker.jobs.announcements``) and looked at
with ``conveyor status``; its ``errors`` hold one OpenAI ``BatchError`` saying why.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from conveyor.worker.batchio.request_body import CHAT
from conveyor.worker.core.settings import Settings
from conveyor.worker.core.storable_text import storable
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.lifecycle import get_job
from conveyor.worker.jobs.submission import check_metadata
from conveyor.worker.jobs.webhook_events import record_job_end
from conveyor.worker.store.models import MODEL_LEN, Job, JobStatus, now


def job_with_key(db: Engine, idempotency_key: str) -> dict[str, Any] | None:
    """The batch object of the job ``idempotency_key`` names, or None."""
    with db.connect() as conn:
        job_id = conn.execute(select(Job.id).where(Job.idempotency_key == idempotency_key)).scalar_one_or_none()
    return None if job_id is None else get_job(db, job_id)


def record_refusal(
    db: Engine,
    settings: Settings,
    *,
    idempotency_key: str,
    code: str,
    message: str,
    param: str | None = None,
    model: Any = None,
    metadata: Any = None,
    notify: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bool]:
    """A ``failed`` job recording a refused submission under ``idempotency_key`` (its model
    and metadata as far as they are valid, its reply target in ``notify``); returns (batch
    object, created). A job that already has the key is returned as it is (created False)."""
    existing = job_with_key(db, idempotency_key)
    if existing is not None:
        return existing, False
    try:
        meta = check_metadata(metadata)
    except ValueError:
        meta = None
    t = now()
    job_id = object_keys.new_job_id()
    try:
        with db.begin() as conn:
            conn.execute(
                insert(Job).values(
                    id=job_id, status=JobStatus.failed, model=storable(model)[:MODEL_LEN],
                    priority=0, endpoint=CHAT, shard_size=settings.shard_size, meta=meta,
                    completion_window=settings.completion_window, created_at=t, updated_at=t, failed_at=t,
                    expires_at=None, idempotency_key=idempotency_key, notify=notify,
                    charged_lines=0, charged_tokens=0,
                    errors=[{"code": code, "message": storable(message), "param": param and storable(param),
                             "line": None}],
                )
            )  # fmt: skip
            record_job_end(conn, job_id, JobStatus.failed, t)
    except IntegrityError:
        existing = job_with_key(db, idempotency_key)
        if existing is None:
            raise
        return existing, False  # a duplicate won the race
    return get_job(db, job_id), True
