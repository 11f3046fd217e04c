"""Publishing the announcement of a job's end (the outbox of ``conveyor.worker.jobs.announcements``).

The message is plain JSON (``content_type`` ``application/json``), not a Celery task: any
kombu consumer (or any AMQP, Redis or SQS client that reads kombu's envelope) reads it.
Its body is ``announcement_body``: ``event`` (``batch.completed``, ``batch.failed``,
``batch.cancelled``, ``batch.expired``), ``job_id``, ``status``, ``idempotency_key`` and
``batch`` (the job's batch object). Its ``message_id`` is ``<job id>:<status>`` and its
``correlation_id`` the submission's idempotency key. Delivery is at least once: dedupe on
the message id.

Where it goes (the job's ``notify``, from the submission's ``reply_to``):

- ``{"queue": name}``: the queue is declared durable (as ``kombu.Queue(name)`` declares it,
  so a producer's own declaration agrees) and the message published through the default
  exchange, with the queue's name as routing key;
- ``{"exchange": name, "type": "direct" | "topic", "routing_key": key}``: the exchange is
  declared durable with that type and the message published to it with that key; binding
  queues to it is the producer's part.

``Announcer.announce`` publishes a job's announcement at once (the worker that ended the job
calls it); ``Announcer.announce_due``, on every worker's periodic thread, publishes those
still due a lease period later (a job cancelled from the CLI or the API, a worker that died
between the two, a publish that failed: tried again every lease period, oldest first).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy.engine import Engine

from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.announcements import Claim, claim, claim_due, mark_announced

log = logging.getLogger(__name__)

# A publish gives up after a few seconds (well within a lease period); the periodic pass
# tries it again once the claim's lease period has passed.
RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1.0}


def describe_target(target: dict[str, Any]) -> str:
    if "queue" in target:
        return f"queue {target['queue']}"
    return f"exchange {target.get('exchange')} ({target.get('type')}, routing key {target.get('routing_key')!r})"


def publish_announcement(app: Celery, target: dict[str, Any], body: dict[str, Any], *, message_id: str,
                         correlation_id: str | None) -> None:  # fmt: skip
    """Publish ``body`` (JSON) to ``target`` on ``app``'s broker; raises when it could not."""
    exchange: Exchange | str
    if "queue" in target:
        name = str(target["queue"])
        exchange, routing_key = "", name
        declare: list[Any] = [Queue(name, routing_key=name, durable=True)]
    elif "exchange" in target:
        exchange = Exchange(str(target["exchange"]), type=str(target.get("type") or "direct"), durable=True)
        routing_key = str(target.get("routing_key") or "")
        declare = [exchange]
    else:
        raise ValueError(f"not a reply target: {target!r:.200}")
    properties: dict[str, Any] = {"message_id": message_id}
    if correlation_id is not None:
        properties["correlation_id"] = correlation_id
    with app.producer_or_acquire() as producer:
        producer.publish(
            body,
            exchange=exchange,
            routing_key=routing_key,
            declare=declare,
            serializer="json",
            delivery_mode=2,  # persistent
            retry=True,
            retry_policy=RETRY_POLICY,
            **properties,
        )


class Announcer:
    """Publishes the announcements of jobs that ended, for one worker process."""

    def __init__(self, app: Celery, db: Engine, settings: Settings) -> None:
        self.app, self.db, self.settings = app, db, settings
        self._failing: set[str] = set()  # jobs whose failed publish was logged (once, until it works)

    def announce(self, job_id: str) -> bool:
        """Publish ``job_id``'s announcement now if it is due (the job ended, names a reply
        target, and was not announced). Never raises: what fails here, the periodic pass
        retries."""
        try:
            taken = claim(self.db, job_id)
        except Exception:
            log.warning("could not claim the announcement of job %s (the periodic pass retries)", job_id, exc_info=True)
            return False
        return taken is not None and self._publish(taken)

    def announce_due(self) -> int:
        """Publish the announcements due for a lease period (every model's jobs); how many."""
        sent = 0
        for taken in claim_due(self.db, lease_seconds=self.settings.lease_seconds):
            sent += self._publish(taken)
        return sent

    def _publish(self, taken: Claim) -> bool:
        where = describe_target(taken.target)
        try:
            publish_announcement(
                self.app, taken.target, taken.body, message_id=taken.message_id, correlation_id=taken.idempotency_key
            )
        except Exception as exc:
            again = taken.job_id in self._failing
            self._failing.add(taken.job_id)
            log.log(logging.DEBUG if again else logging.WARNING, "could not announce job %s to %s: %s: %s "
                    "(tried again every lease period until it works)", taken.job_id, where, type(exc).__name__,
                    exc)  # fmt: skip
            return False  # the claim stays: the periodic pass takes it again a lease period later
        try:
            mark_announced(self.db, taken)
        except Exception:  # published: the next pass publishes it again (at least once)
            log.warning("announced job %s but could not record it", taken.job_id, exc_info=True)
        self._failing.discard(taken.job_id)
        log.info("announced job %s %s to %s", taken.job_id, taken.body["status"], where)
        return True
