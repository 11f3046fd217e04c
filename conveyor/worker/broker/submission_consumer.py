"""Broker submissions taken by the API server: work that arrives by message while no worker runs.

A ``conveyor.submit_job`` message waits on ``<prefix>-submit`` until something consumes it, and
the demand an autoscaler reads comes from the database (``conveyor.worker.metrics.db_collector``): a
message nobody has taken is work the trigger cannot see, so with every worker scaled to zero
it would wait for ever. ``conveyor serve`` therefore consumes that queue too, beside every
worker (``CONVEYOR_API_TAKES_SUBMISSIONS``, on by default). It does what a worker's
``submit_job`` task does (``handle_submission``): the job is recorded ``validating`` under
the message's idempotency key and its intake is sent; from then on it counts in
``conveyor_demand`` for its model, and the worker started for it runs the intake.

Messages are read as a worker's Celery reads them: JSON only (another serializer is refused
when the body is decoded), the envelope checked (``conveyor.worker.broker.envelope``), a task other
than ``conveyor.submit_job`` discarded as Celery discards an unregistered one, one message
at a time, acknowledged once its job and intake are recorded (handling a message twice is
safe: its key finds the job). While the database, the object store or the broker cannot take
the job, the message goes back to the queue and the consumer pauses, backing off up to
``MAX_BACKOFF_SECONDS``; a lost broker connection is opened again the same way.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any

from celery import Celery
from sqlalchemy.engine import Engine

from conveyor.worker.broker.announce import Announcer
from conveyor.worker.broker.envelope import body_problem, header_problem, size_problem
from conveyor.worker.broker.queues import SUBMIT_JOB, enqueue_intake, model_queue, submit_queue_name
from conveyor.worker.broker.submissions import IntakeNotSent, handle_submission, intake_sender
from conveyor.worker.core.settings import Settings
from conveyor.worker.store.faults import dependency_of
from conveyor.worker.store.objects.base import ObjectStore

log = logging.getLogger(__name__)

DRAIN_SECONDS = 1.0  # how often the loop looks up from the broker (to stop, to heartbeat)
MAX_BACKOFF_SECONDS = 30.0


class Verdict(enum.Enum):
    ack = "ack"  # taken (or refused as the contract says: recorded, logged)
    requeue = "requeue"  # a dependency is down: back to the queue, pause
    reject = "reject"  # not a message anyone can take: dropped, as Celery drops it


class SubmissionConsumer:
    """One consumer of the submission queue on a thread of its own (``start``, ``stop``)."""

    def __init__(self, app: Celery, db: Engine, store: ObjectStore, settings: Settings) -> None:
        self.app, self.db, self.store, self.settings = app, db, store, settings
        self.queue = submit_queue_name(settings.queue_prefix)
        self._announcer = Announcer(app, db, settings)
        self._intake = intake_sender(lambda job_id: enqueue_intake(app, job_id, settings.queue_prefix))
        self._stop = threading.Event()
        self._backoff = 1.0
        self._thread = threading.Thread(target=self._run, name="conveyor-submissions", daemon=True)
        self.taken = 0  # messages acknowledged

    def start(self) -> SubmissionConsumer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- one message ------------------------------------------------------------------

    def take(self, headers: Any, body: Any) -> Verdict:
        """What to do with one decoded message (its job recorded when it is one to take)."""
        problem = header_problem(headers) or body_problem(body)
        if problem is not None:
            log.error("submissions: dropped a message on %s: malformed task message: %s", self.queue, problem)
            return Verdict.reject
        task, task_id = headers.get("task"), headers["id"]
        if task != SUBMIT_JOB:
            log.error("submissions: dropped task %r (id %s) on %s: only %s is taken here", task, task_id, self.queue,
                      SUBMIT_JOB)  # fmt: skip
            return Verdict.reject
        args, kwargs, _embed = body
        try:
            handle_submission(
                self.db, self.store, self.settings, args, kwargs,
                enqueue_intake=self._intake, announce=self._announcer.announce, task_id=task_id,
            )  # fmt: skip
        except IntakeNotSent as exc:
            log.warning("submissions: %s; the submission goes back to the queue", exc)
            return Verdict.requeue
        except Exception as exc:
            if dependency_of(exc) is None:
                log.exception("submissions: task %s failed; dropped", task_id)
                return Verdict.reject
            log.warning("submissions: task %s: %s: %s; back to the queue", task_id, type(exc).__name__, exc)
            return Verdict.requeue
        return Verdict.ack

    def _on_message(self, body: Any, message: Any) -> None:
        too_big = size_problem(message.body, self.settings.max_message_bytes)
        if too_big is not None:
            log.error("submissions: dropped a message on %s: %s", self.queue, too_big)
        verdict = Verdict.reject if too_big is not None else self.take(message.headers, body)
        if verdict is Verdict.ack:
            message.ack()
            self.taken += 1
            self._backoff = 1.0
        elif verdict is Verdict.reject:
            message.reject()
        else:
            message.requeue()
            self._pause()

    def _on_decode_error(self, message: Any, exc: Exception) -> None:
        log.error("submissions: dropped a message on %s that is not JSON: %s", self.queue, exc)
        message.reject()

    # ---- the loop ---------------------------------------------------------------------

    def _pause(self) -> None:
        self._stop.wait(self._backoff)
        self._backoff = min(MAX_BACKOFF_SECONDS, self._backoff * 2)

    def _run(self) -> None:
        down = False
        while not self._stop.is_set():
            try:
                with self.app.connection_for_read() as conn:
                    conn.ensure_connection(max_retries=1)
                    with conn.Consumer(
                        [model_queue(self.queue)],
                        callbacks=[self._on_message],
                        on_decode_error=self._on_decode_error,
                        accept=["json"],
                        prefetch_count=1,
                    ):
                        if down:
                            log.warning("submissions: the broker is back; taking submissions from %s", self.queue)
                        down = False
                        self._backoff = 1.0
                        while not self._stop.is_set():
                            try:
                                conn.drain_events(timeout=DRAIN_SECONDS)
                            except TimeoutError:
                                conn.heartbeat_check()
            except Exception as exc:  # kombu raises each transport's own errors
                if not down:
                    log.warning("submissions: cannot consume %s: %s: %s; trying again", self.queue,
                                type(exc).__name__, exc)  # fmt: skip
                down = True
                self._pause()
