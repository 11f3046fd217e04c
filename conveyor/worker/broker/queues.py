"""The broker contract: task names, one queue per model, and the helpers that enqueue.

Everything that sends to or inspects a queue imports it from here (the Celery app, the
tasks, the worker's sweeper wiring, the client), so no two of them need each other. Task
arguments are JSON: ``conveyor.run_shard(job_id, shard_index)``,
``conveyor.finalize_job(job_id, redo)`` and ``conveyor.ingest_job(job_id)``; a producer in
any language can send them. ``conveyor.submit_job(**fields)``, on the submission queue, is the
one meant for producers outside Conveyor (``conveyor.worker.broker.submission_contract``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from celery import Celery
from kombu import Exchange, Queue

from conveyor.worker.core.settings import redact_url
from conveyor.worker.jobs.model_names import model_slug

log = logging.getLogger(__name__)

CONVEYOR_TASKS = "conveyor."  # the prefix of every task a worker runs: no other is registered
RUN_SHARD = "conveyor.run_shard"
FINALIZE_JOB = "conveyor.finalize_job"
INGEST_JOB = "conveyor.ingest_job"
SUBMIT_JOB = "conveyor.submit_job"
DEFAULT_QUEUE = "conveyor-unconfigured"  # a worker with no model refuses to start anyway


# A submit checks the broker this long at most before it uploads anything.
BROKER_CHECK_SECONDS = 5.0


class BrokerUnavailable(RuntimeError):
    """The broker cannot be reached (the message names its URL, redacted, and the setting)."""


def check_broker(app: Celery) -> None:
    """``BrokerUnavailable`` unless a connection to the broker opens now (within seconds)."""
    url = app.conf.broker_url
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0.2, interval_step=0.2, timeout=BROKER_CHECK_SECONDS)
    except Exception as exc:  # kombu wraps each transport's errors differently
        raise BrokerUnavailable(
            f"cannot reach the broker at {redact_url(url)}: {exc} (check CONVEYOR_BROKER_URL and that the broker runs)"
        ) from None


def queue_name(model: str, prefix: str = "conveyor") -> str:
    """The queue of the shard tasks of ``model`` (a canonical id, as stored on the job)."""
    return f"{prefix}-{model_slug(model)}"


def intake_queue_name(prefix: str = "conveyor") -> str:
    """The queue of ``ingest_job`` tasks: every worker consumes it, whatever its model (an
    intake needs only the database and the store)."""
    return f"{prefix}-intake"


def submit_queue_name(prefix: str = "conveyor") -> str:
    """The queue of ``submit_job`` messages (broker-level submission, the public contract):
    every worker consumes it, whatever its model."""
    return f"{prefix}-submit"


def model_queue(name: str) -> Queue:
    """The kombu queue of one model (a direct exchange of the same name)."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name, durable=True)


def enqueue_shards(app: Celery, queue: str, job_id: str, indices: Sequence[int]) -> None:
    """One ``run_shard`` message per shard on ``queue`` (one broker connection for all)."""
    target = model_queue(queue)
    with app.producer_or_acquire() as producer:
        for index in indices:
            app.send_task(RUN_SHARD, args=[job_id, int(index)], queue=target, producer=producer)


def enqueue_finalize(app: Celery, queue: str, job_id: str, redo: bool) -> None:
    app.send_task(FINALIZE_JOB, args=[job_id, bool(redo)], queue=model_queue(queue))


def enqueue_intake(app: Celery, job_id: str, prefix: str = "conveyor") -> None:
    """Have a worker ingest a ``create_job`` job's stored input (``conveyor.ingest_job``)."""
    app.send_task(INGEST_JOB, args=[job_id], queue=model_queue(intake_queue_name(prefix)))


def queue_depth(app: Celery, queue: str) -> int | None:
    """Messages ready on ``queue`` (None if the broker cannot tell right now)."""
    try:
        with app.connection_for_write() as conn:
            _name, count, _consumers = model_queue(queue)(conn.default_channel).queue_declare()
            return int(count)
    except Exception:
        log.debug("could not read the depth of queue %s", queue, exc_info=True)
        return None
