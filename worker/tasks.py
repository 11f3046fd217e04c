"""The Celery tasks (JSON arguments only) and the helpers that enqueue them.

- ``conveyor.run_shard(job_id, shard_index)``: run one shard (``worker.shards``). A failed
  attempt is retried with backoff up to ``CONVEYOR_SHARD_MAX_ATTEMPTS``; after that the
  shard's remaining items become error records and the job goes on.
- ``conveyor.finalize_job(job_id, redo)``: finalise a job the sweeper found unfinished.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import Celery

from worker import keys
from worker.app import FINALIZE_JOB, RUN_SHARD, model_queue
from worker.finalize import finalize_if_ready, finalize_job

log = logging.getLogger(__name__)

RETRY_BACKOFF = (2.0, 10.0, 30.0, 60.0)


def _shard_index(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"shard_index must be a non-negative integer, got {value!r:.40}")
    return value


def register_tasks(app: Celery) -> None:
    """Define the tasks on ``app`` (the engine is imported only when a task runs)."""
    from worker.service import worker_context

    @app.task(name=RUN_SHARD, bind=True, shared=False, acks_late=True, reject_on_worker_lost=True, max_retries=None)
    def run_shard_task(self: Any, job_id: str, shard_index: int) -> dict[str, Any]:
        from worker.shards import RetryShard, run_shard

        keys.check_job_id(job_id)
        ctx = worker_context(app)
        try:
            outcome = run_shard(ctx, job_id, _shard_index(shard_index))
        except RetryShard as exc:
            countdown = RETRY_BACKOFF[min(exc.attempts, len(RETRY_BACKOFF)) - 1]
            log.warning("shard %s/%s will be retried in %.0f s: %s", job_id, shard_index, countdown, exc)
            raise self.retry(countdown=countdown, max_retries=None) from None
        log.info("shard %s/%d: %s (%d items)%s", job_id, shard_index, outcome.status, outcome.items,
                 f" [{outcome.reason}]" if outcome.reason else "")  # fmt: skip
        return outcome.as_dict()

    @app.task(name=FINALIZE_JOB, bind=True, shared=False, acks_late=True, reject_on_worker_lost=True)
    def finalize_job_task(self: Any, job_id: str, redo: bool = False) -> dict[str, Any]:
        keys.check_job_id(job_id)
        ctx = worker_context(app)
        hb = ctx.settings.heartbeat_seconds
        result = finalize_job(ctx.db, ctx.store, job_id, heartbeat_seconds=hb) if redo is True else None
        if result is None:
            result = finalize_if_ready(ctx.db, ctx.store, job_id, heartbeat_seconds=hb)
        return {"job_id": job_id, "status": result.status.value if result else None}


def enqueue_shards(app: Celery, queue: str, job_id: str, indices: Sequence[int]) -> None:
    """One ``run_shard`` message per shard on ``queue`` (one broker connection for all)."""
    target = model_queue(queue)
    with app.producer_or_acquire() as producer:
        for index in indices:
            app.send_task(RUN_SHARD, args=[job_id, int(index)], queue=target, producer=producer)


def enqueue_finalize(app: Celery, queue: str, job_id: str, redo: bool) -> None:
    app.send_task(FINALIZE_JOB, args=[job_id, bool(redo)], queue=model_queue(queue))
