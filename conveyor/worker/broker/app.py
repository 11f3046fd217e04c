"""The worker's Celery app, the composition root of a worker process: configuration
(``conveyor.worker.broker.config``), the tasks, the process signals and the per-app state.

``celery -A conveyor.worker.app worker`` works with the model in ``CONVEYOR_MODEL`` (the worker
consumes that model's queue with a threads pool); ``conveyor worker --model M`` builds the
same app for ``M``. The worker checks its configuration and the database schema before it
consumes anything, loads the model once per process, and runs two background threads
(``conveyor.worker.broker.worker_process``): the sweeper and the engine snapshots.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from conveyor.worker.broker.app_state import AppState
from conveyor.worker.broker.config import celery_app
from conveyor.worker.broker.queues import CONVEYOR_TASKS, DEFAULT_QUEUE, queue_name
from conveyor.worker.broker.tasks import register_tasks
from conveyor.worker.broker.worker_process import add_consumer_steps, connect_signals
from conveyor.worker.core.settings import Settings, get_settings
from conveyor.worker.jobs.model_names import canonical_model, check_served_name


def create_app(settings: Settings | None = None, model: str | None = None) -> Celery:
    """A worker app on the configured broker; with a model, its queue is the default one."""
    settings = settings or get_settings()
    name = model or settings.model
    canonical = canonical_model(name) if name else None
    # Jobs name the model by its served name when it has one; its queue is named from it.
    served = check_served_name(settings.served_model_name) if settings.served_model_name else canonical
    queue = queue_name(served, settings.queue_prefix) if served else DEFAULT_QUEUE
    app = celery_app(settings, queue)
    app.conveyor = AppState(settings, canonical, queue)
    register_tasks(app)
    drop_foreign_tasks(app)
    close_broadcasts(app)
    add_consumer_steps(app)
    connect_signals()
    return app


def drop_foreign_tasks(app: Celery) -> None:
    """Unregister every task but Conveyor's: Celery's built-ins (``celery.accumulate``,
    ``celery.map``, ``celery.chord_unlock``...) would run for anyone who may publish a job. A
    message naming one is then refused as an unregistered task (logged, not requeued)."""
    app.finalize(auto=True)
    for name in [name for name in app.tasks if not name.startswith(CONVEYOR_TASKS)]:
        app.tasks.unregister(name)


def close_broadcasts(app: Celery) -> None:
    """Start every worker of ``app`` without mingle, gossip and heartbeat events, whatever the
    command line (``conveyor worker`` or plain ``celery -A conveyor.worker.app worker``): they listen and
    send on broadcast exchanges any broker user may write to (mingle would take a list of
    revoked task ids from whoever answers), and Conveyor needs none of them."""
    base = app.Worker

    class Worker(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(without_mingle=True, without_gossip=True, without_heartbeat=True)
            super().__init__(*args, **kwargs)

    app.Worker = Worker
