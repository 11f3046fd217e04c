"""The Celery tasks (JSON arguments only; names and enqueue helpers in ``conveyor.worker.broker.queues``).

- ``conveyor.run_shard(job_id, shard_index)``: a turn to run one of the model's pending shards,
  fairly between owners (``conveyor.worker.execution.shard_turns``; the named one when none waits).
  A failed attempt is retried with backoff up to ``CONVEYOR_SHARD_MAX_ATTEMPTS``; after that
  the shard's remaining items become error records and the job goes on.
- ``conveyor.finalize_job(job_id, redo)``: finalise a job the sweeper found unfinished.
- ``conveyor.ingest_job(job_id)``: stream a ``create_job`` job's stored input into shards and
  enqueue them on the job's model queue (idempotent: a redelivery finds the job started).
- ``conveyor.submit_job(**fields)``: a job submitted through the broker by reference to a
  stored input (``conveyor.worker.broker.submission_contract``, ``conveyor.worker.broker.submissions``).

Every task reads its message through ``conveyor.worker.broker.envelope.CheckedRequest``: a malformed
envelope is rejected and logged, instead of stopping the worker.

A task that ends a job (its last shard, a finalisation, an intake that failed) announces
the end at once when the job names a reply target (``conveyor.worker.broker.announce``).

A worker that is stopping (SIGTERM, ``--exit-when-idle``: ``ProcessState``) hands a shard or
an intake back to the broker instead of starting it, and a shard it had to interrupt goes
back the same way (its lease released: another worker resumes it at once). Every task marks
the process busy while it runs, which is what ``--exit-when-idle`` measures.

A database or storage outage never acknowledges a message unprocessed: the task waits for
the dependency (the context's ``DependencyGate``) and then does its work; after
``CONVEYOR_DEPENDENCY_RETRY_SECONDS`` of outage it rejects the message back onto the queue,
to be delivered again, instead of raising (Celery would log it and ack it: the message lost).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from celery import Celery
from celery.exceptions import Reject

from conveyor.worker.broker.announce import Announcer
from conveyor.worker.broker.app_state import require_state
from conveyor.worker.broker.envelope import REQUEST as CHECKED_REQUEST
from conveyor.worker.broker.queues import (
    FINALIZE_JOB,
    INGEST_JOB,
    RUN_SHARD,
    SUBMIT_JOB,
    enqueue_intake,
    enqueue_shards,
    queue_name,
)
from conveyor.worker.broker.submissions import IntakeNotSent, handle_submission, intake_sender
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.dependency_gate import DependencyUnavailable
from conveyor.worker.execution.shard_runner import RetryShard
from conveyor.worker.execution.shard_turns import run_next_shard
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.finalize import FinalizeResult, finalize_if_ready, finalize_job
from conveyor.worker.jobs.lifecycle import JobNotFound, job_model
from conveyor.worker.jobs.submission import ingest_job
from conveyor.worker.store.models import JobStatus

log = logging.getLogger(__name__)

RETRY_BACKOFF = (2.0, 10.0, 30.0, 60.0)


def _shard_index(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"shard_index must be a non-negative integer, got {value!r:.40}")
    return value


# Every task: JSON arguments checked by ``CheckedRequest``, acknowledged after it ran, requeued
# if the worker process dies mid-task.
TASK_OPTIONS: dict[str, Any] = {
    "bind": True, "shared": False, "acks_late": True, "reject_on_worker_lost": True, "Request": CHECKED_REQUEST,
}  # fmt: skip


def register_tasks(app: Celery) -> None:
    """Define the tasks on ``app``; they run in the context ``app.conveyor`` creates."""
    state = require_state(app)

    @contextlib.contextmanager
    def busy() -> Iterator[WorkerContext]:
        ctx = state.context()
        ctx.state.task_started()
        try:
            yield ctx
        finally:
            ctx.state.task_finished()

    @app.task(name=RUN_SHARD, max_retries=None, **TASK_OPTIONS)
    def run_shard_task(self: Any, job_id: str, shard_index: int) -> dict[str, Any]:
        object_keys.check_job_id(job_id)
        with busy() as ctx:
            return run_shard(app, ctx, job_id, _shard_index(shard_index))

    @app.task(name=FINALIZE_JOB, **TASK_OPTIONS)
    def finalize_job_task(self: Any, job_id: str, redo: bool = False) -> dict[str, Any]:
        object_keys.check_job_id(job_id)
        with busy() as ctx:
            return finalize(app, ctx, job_id, redo)

    @app.task(name=INGEST_JOB, **TASK_OPTIONS)
    def ingest_job_task(self: Any, job_id: str) -> dict[str, Any]:
        object_keys.check_job_id(job_id)
        with busy() as ctx:
            if ctx.state.draining:
                hand_back(f"the intake of job {job_id}", lambda: enqueue_intake(app, job_id, ctx.settings.queue_prefix))
                return {"job_id": job_id, "status": None}
            with requeued_on_outage():
                return run_intake(app, ctx, job_id)

    @app.task(name=SUBMIT_JOB, **TASK_OPTIONS)
    def submit_job_task(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with busy() as ctx:
            return submit(app, ctx, self.request.id, args, kwargs)


@contextlib.contextmanager
def requeued_on_outage(what: str = "the message") -> Iterator[None]:
    """A dependency that stayed down (or a submission whose intake could not be sent) puts the
    message back on its queue, to be delivered again, instead of raising: Celery would log the
    error and acknowledge the message, which would then be lost."""
    try:
        yield
    except (DependencyUnavailable, IntakeNotSent) as exc:
        log.warning("%s; handing %s back to the broker", exc, what)
        raise Reject(str(exc), requeue=True) from None


def hand_back(what: str, send: Callable[[], None]) -> None:
    """Put a message back on its queue, for another worker, as a new message (this one is then
    acknowledged): a quiet log, unlike a rejection's traceback."""
    try:
        send()
    except Exception as exc:  # the broker is not taking messages: it keeps this one instead
        raise Reject(f"{what}: the worker is stopping and could not re-send it ({exc})", requeue=True) from None
    log.info("%s: sent back to the queue for another worker (this one is stopping)", what)


def announce(app: Celery, ctx: WorkerContext, job_id: str) -> None:
    Announcer(app, ctx.db, ctx.settings).announce(job_id)


def run_shard(app: Celery, ctx: WorkerContext, job_id: str, shard_index: int) -> dict[str, Any]:
    """A turn to run one of the model's pending shards; a failed attempt waits its backoff and
    goes back on the queue as a new message."""
    queue = queue_name(ctx.model, ctx.settings.queue_prefix)
    try:
        with requeued_on_outage():
            outcome = run_next_shard(ctx, job_id, shard_index)
    except RetryShard as exc:
        delay = RETRY_BACKOFF[min(exc.attempts, len(RETRY_BACKOFF)) - 1]
        log.warning("shard %s/%s will be retried in %.0f s: %s", job_id, shard_index, delay, exc)
        # Waited out here and sent again as a new message, not with a countdown: Conveyor's
        # queues refuse delayed messages (``conveyor.worker.broker.envelope``). A stop cuts it short.
        until = time.monotonic() + delay
        while time.monotonic() < until and not ctx.state.hand_back_due():
            time.sleep(0.2)
        try:
            enqueue_shards(app, queue, job_id, [shard_index])
        except Exception as send_error:  # the broker keeps this message instead
            raise Reject(f"shard {job_id}/{shard_index}: not re-sent ({send_error})", requeue=True) from None
        return {"job_id": job_id, "shard_index": shard_index, "status": "retrying"}
    reason = f" [{outcome.reason}]" if outcome.reason else ""
    log.info("shard %s/%d: %s (%d items)%s", outcome.job_id, outcome.shard_index, outcome.status, outcome.items, reason)
    if outcome.status == "handed_back":
        hand_back(f"shard {job_id}/{shard_index}", lambda: enqueue_shards(app, queue, job_id, [shard_index]))
    if outcome.finalized:
        announce(app, ctx, job_id)
    return outcome.as_dict()


def finalize(app: Celery, ctx: WorkerContext, job_id: str, redo: bool) -> dict[str, Any]:
    """Finalise a job the sweeper found unfinished (``redo``: write its results again)."""
    hb = ctx.settings.heartbeat_seconds

    def attempt() -> FinalizeResult | None:
        result = finalize_job(ctx.db, ctx.store, job_id, heartbeat_seconds=hb) if redo is True else None
        return result or finalize_if_ready(ctx.db, ctx.store, job_id, heartbeat_seconds=hb)

    with requeued_on_outage():
        result = ctx.gate.call(
            attempt,
            what=f"finalising job {job_id}",
            patience=ctx.settings.dependency_retry_seconds,
            give_up=ctx.state.hand_back_due,
        )
    if result is not None:
        announce(app, ctx, job_id)
    return {"job_id": job_id, "status": result.status.value if result else None}


def submit(app: Celery, ctx: WorkerContext, task_id: str, args: Any, kwargs: Any) -> dict[str, Any]:
    """A job submitted through the broker by reference to a stored input."""
    intake = intake_sender(lambda job_id: enqueue_intake(app, job_id, ctx.settings.queue_prefix))
    with requeued_on_outage("the submission"):
        return ctx.gate.call(
            lambda: handle_submission(
                ctx.db, ctx.store, ctx.settings, args, kwargs,
                enqueue_intake=intake, announce=lambda job_id: announce(app, ctx, job_id), task_id=task_id,
            ),
            what="taking a submission",
            patience=ctx.settings.dependency_retry_seconds,
            give_up=ctx.state.hand_back_due,
        )  # fmt: skip


def run_intake(app: Celery, ctx: WorkerContext, job_id: str) -> dict[str, Any]:
    """Ingest job ``job_id``'s stored input and enqueue its shards (``DependencyUnavailable``
    after a dependency stayed down too long); announce the job's end if it ended at once.
    What both the intake lane (``conveyor.worker.broker.intake_lane``) and the ``ingest_job`` task run."""
    prefix = ctx.settings.queue_prefix

    def send(job_id: str, indices: Any) -> None:
        enqueue_shards(app, queue_name(job_model(ctx.db, job_id), prefix), job_id, indices)

    try:
        job = ctx.gate.call(
            lambda: ingest_job(ctx.db, ctx.store, ctx.settings, job_id, enqueue=send),
            what=f"ingesting job {job_id}",
            patience=ctx.settings.dependency_retry_seconds,
            give_up=ctx.state.hand_back_due,
        )
    except JobNotFound:
        log.warning("ingest_job: no job %s (deleted?); dropping the message", job_id)
        return {"job_id": job_id, "status": None}
    log.info("job %s ingested: %s", job_id, job["status"])
    if JobStatus(job["status"]).terminal:  # its input was refused, or it had no request
        Announcer(app, ctx.db, ctx.settings).announce(job_id)
    return {"job_id": job_id, "status": job["status"]}
