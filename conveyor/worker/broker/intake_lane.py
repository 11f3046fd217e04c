"""The intake lane: every worker consumes the intake queue on a thread of its own.

An intake (``conveyor.ingest_job``: a batch's stored file read into shards) is short work
that decides when a new batch can start at all. Consumed by Celery's pool, it waited for a
free thread behind shards that may run for hours, so a second owner's one-line batch sat in
``validating`` until the first owner's backlog ended. Here it has its own consumer (plain
kombu, ``ConsumerMixin``: reconnects included), one message at a time, whatever the shards
do; the Celery pool no longer consumes ``<prefix>-intake``.

Messages are read as Celery reads them: JSON only, the envelope checked
(``conveyor.worker.broker.envelope``), a task other than ``conveyor.ingest_job`` dropped as Celery
drops an unregistered one. A message is acknowledged once its intake is done (a redelivery
finds the job started and does nothing); while a dependency is down too long, or once the
worker is stopping, it goes back to the queue for another worker.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery
from kombu.mixins import ConsumerMixin

from conveyor.worker.broker.envelope import MAX_BYTES_OPTION, body_problem, header_problem, size_problem
from conveyor.worker.broker.queues import INGEST_JOB, intake_queue_name, model_queue
from conveyor.worker.broker.tasks import run_intake
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.dependency_gate import DependencyUnavailable
from conveyor.worker.jobs import object_keys

log = logging.getLogger(__name__)


class IntakeLane(ConsumerMixin):
    """``start`` consumes the intake queue on a daemon thread; ``stop`` ends it."""

    def __init__(self, app: Celery, ctx: WorkerContext) -> None:
        self.app, self.ctx = app, ctx
        self.queue = intake_queue_name(ctx.settings.queue_prefix)
        self.connection = app.connection_for_read()
        self._thread = threading.Thread(target=self.run, name="conveyor-intake", daemon=True)

    def get_consumers(self, Consumer: Any, channel: Any) -> list[Any]:
        return [
            Consumer(
                queues=[model_queue(self.queue)],
                callbacks=[self._on_message],
                on_decode_error=self._on_decode_error,
                accept=["json"],
                prefetch_count=1,
            )
        ]

    def start(self) -> IntakeLane:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop consuming (the loop looks up every second; an intake under way finishes or
        hands its message back: ``run_intake`` gives up once the hand-back time comes)."""
        self.should_stop = True
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.connection.release()

    def _on_decode_error(self, message: Any, exc: Exception) -> None:
        log.error("intake: dropped a message on %s that is not JSON: %s", self.queue, exc)
        message.reject()

    def _on_message(self, body: Any, message: Any) -> None:
        headers = message.headers
        limit = getattr(self.app.conf, MAX_BYTES_OPTION, None)
        problem = size_problem(message.body, limit) or header_problem(headers) or body_problem(body)
        if problem is None and headers.get("task") != INGEST_JOB:
            problem = f"task {headers.get('task')!r}: only {INGEST_JOB} is taken here"
        job_id = ""
        if problem is None:
            try:
                job_id = object_keys.check_job_id(_job_id(body))
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            log.error("intake: dropped a message on %s: %s", self.queue, problem)
            message.reject()
            return
        state = self.ctx.state
        if state.draining:
            message.requeue()
            self.should_stop = True  # a stopping worker takes no new intake
            return
        state.task_started()
        try:
            run_intake(self.app, self.ctx, job_id)
        except DependencyUnavailable as exc:
            log.warning("%s; handing the intake back to the broker", exc)
            message.requeue()
            return
        except Exception:
            log.exception("intake of job %s failed", job_id)  # as a Celery task failing: acknowledged
        finally:
            state.task_finished()
        message.ack()


def _job_id(body: Any) -> Any:
    """``ingest_job``'s one argument, given by position or by name."""
    args, kwargs, _embed = body
    if len(args) == 1 and not kwargs:
        return args[0]
    if not args and set(kwargs) == {"job_id"}:
        return kwargs["job_id"]
    return None
