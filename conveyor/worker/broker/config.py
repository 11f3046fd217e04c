"""The Celery configuration every Conveyor app shares: JSON only, late acks, reject on
worker lost, prefetch 1, one queue per model.

``celery_app`` is enough to send (the client, ``conveyor submit``): it registers no task and
imports no engine. The worker's app (``conveyor.worker.broker.app``) adds the tasks and signals.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from conveyor.worker.broker.envelope import MAX_BYTES_OPTION
from conveyor.worker.broker.queues import model_queue, submit_queue_name
from conveyor.worker.core.settings import Settings


def transport_options(settings: Settings) -> dict[str, Any]:
    broker = settings.broker
    options: dict[str, Any] = {}
    if broker.startswith(("redis", "rediss", "sqs")):
        options["visibility_timeout"] = settings.broker_visibility_timeout
    if broker.startswith(("amqp", "amqps", "pyamqp")):
        # py-amqp waits for a synchronous reply with no time limit of its own (issue 40's
        # RabbitMQ restart once left a consumer blocked in basic_qos): SO_RCVTIMEO bounds it.
        options["read_timeout"] = settings.broker_read_timeout
    options.update(settings.broker_transport_options)
    return options


def celery_app(settings: Settings, queue: str) -> Celery:
    """A Celery app on the configured broker whose default queue is ``queue``."""
    app = Celery("conveyor", set_as_current=False)
    app.conf.update(
        broker_url=settings.broker,
        broker_transport_options=transport_options(settings),
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        worker_pool="threads",
        worker_concurrency=settings.worker_concurrency,
        task_default_queue=queue,
        # Every worker also takes broker-level submissions, whatever its model. (It ingests
        # stored inputs too, from ``<prefix>-intake``, but on a lane of its own, not in this
        # pool: ``conveyor.worker.broker.intake_lane``.)
        task_queues=[
            model_queue(queue),
            model_queue(submit_queue_name(settings.queue_prefix)),
        ],
        worker_hijack_root_logger=True,
        worker_log_color=False,
        # Whoever may publish a job must not steer the fleet: no remote control (shutdown,
        # cancel_consumer, inspect, ping), no events to read or forge.
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        **{MAX_BYTES_OPTION: settings.max_message_bytes},
    )
    return app
