"""The Celery app: JSON only, late acks, reject on worker lost, prefetch 1, one queue per model.

``celery -A worker.app worker`` works with the model in ``CONVEYOR_MODEL`` (the worker
consumes that model's queue with a threads pool); ``conveyor worker --model M`` builds the
same app for ``M``. The worker checks its configuration and the database schema before it
consumes anything, loads the model once per process, and runs two background threads
(``worker.service``): the sweeper and the engine snapshots.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from worker.queues import canonical_model, queue_name
from worker.settings import Settings, get_settings

RUN_SHARD = "conveyor.run_shard"
FINALIZE_JOB = "conveyor.finalize_job"
DEFAULT_QUEUE = "conveyor-unconfigured"  # a worker with no model refuses to start anyway


def model_queue(name: str) -> Queue:
    """The kombu queue of one model (a direct exchange of the same name)."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name, durable=True)


def transport_options(settings: Settings) -> dict[str, Any]:
    broker = settings.broker
    options: dict[str, Any] = {}
    if broker.startswith(("redis", "rediss", "sqs")):
        options["visibility_timeout"] = settings.broker_visibility_timeout
    options.update(settings.broker_transport_options)
    return options


def create_app(settings: Settings | None = None, model: str | None = None) -> Celery:
    """A Celery app on the configured broker; with a model, its queue is the default one."""
    settings = settings or get_settings()
    name = model or settings.model
    canonical = canonical_model(name) if name else None
    queue = queue_name(canonical, settings.queue_prefix) if canonical else DEFAULT_QUEUE
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
        task_queues=[model_queue(queue)],
        worker_hijack_root_logger=True,
        worker_log_color=False,
    )
    app.conveyor_settings = settings  # type: ignore[attr-defined]
    app.conveyor_model = canonical  # type: ignore[attr-defined]
    from worker import service, tasks

    tasks.register_tasks(app)
    service.connect_signals()
    return app


def __getattr__(name: str) -> Celery:
    """``worker.app.app`` (what ``celery -A worker.app`` loads), built on first access from
    the environment, so importing this module for ``create_app`` has no side effects."""
    if name not in ("app", "celery"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global _app
    if _app is None:
        try:
            _app = create_app()
        except Exception as exc:  # a bad CONVEYOR_* value: say which, without a traceback
            raise SystemExit(f"conveyor: cannot configure the Celery app: {exc}") from None
    return _app


_app: Celery | None = None
