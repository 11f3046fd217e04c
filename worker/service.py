"""A worker process's life around the Celery consumer.

- ``worker_init``: refuse to start on a bad configuration or an outdated database schema
  (the message says what to run), then load the model (threads/solo pools: once, before
  consuming; a prefork child loads its own on first use).
- ``worker_ready``: start the sweeper and the engine-snapshot threads.
- ``worker_shutdown``: stop them and the engine host.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from typing import TYPE_CHECKING

from celery import Celery, signals

from worker.periodic import Periodic
from worker.store.schema import check_schema, upgrade_database

if TYPE_CHECKING:  # the engine (torch) is imported only in worker processes
    from worker.context import WorkerContext

log = logging.getLogger(__name__)

_contexts: dict[int, "WorkerContext"] = {}
_background: dict[int, list[Periodic]] = {}
_lock = threading.Lock()
_connected = False


def worker_context(app: Celery) -> WorkerContext:
    """The process's context for ``app`` (created once, on first use)."""
    from worker.context import WorkerContext

    key = id(app)
    ctx = _contexts.get(key)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(key)
            if ctx is None:
                ctx = WorkerContext.create(app.conveyor_settings, app.conveyor_model)
                _contexts[key] = ctx
    return ctx


def prepare_database(ctx: WorkerContext) -> str:
    """Embedded SQLite: migrate it (it is ours). Anything else: check, never migrate."""
    if ctx.settings.database_url is None:
        return upgrade_database(ctx.settings.database)
    return check_schema(ctx.db)


def queue_depth(app: Celery, queue: str) -> int | None:
    """Messages ready on ``queue`` (None if the broker cannot tell right now)."""
    from worker.app import model_queue

    try:
        with app.connection_for_write() as conn:
            _name, count, _consumers = model_queue(queue)(conn.default_channel).queue_declare()
            return int(count)
    except Exception:  # noqa: BLE001
        log.debug("could not read the depth of queue %s", queue, exc_info=True)
        return None


def start_background(app: Celery) -> list[Periodic]:
    from worker.snapshots import SnapshotWriter
    from worker.sweeper import Sweeper
    from worker.tasks import enqueue_finalize, enqueue_shards

    ctx = worker_context(app)
    s = ctx.settings
    sweeper = Sweeper(
        ctx,
        enqueue_shard=lambda job_id, index: enqueue_shards(app, ctx.queue, job_id, [index]),
        enqueue_finalize=lambda job_id, redo: enqueue_finalize(app, ctx.queue, job_id, redo),
        queue_depth=lambda: queue_depth(app, ctx.queue),
    )
    threads = [
        Periodic("conveyor-sweeper", s.sweep_interval_seconds, sweeper.sweep_once).start(),
        Periodic("conveyor-snapshots", s.snapshot_interval_seconds, SnapshotWriter(ctx).write_once).start(),
    ]
    _background[id(app)] = threads
    return threads


def _conveyor_app(sender: Any) -> Celery | None:
    app = getattr(sender, "app", None)
    return app if getattr(app, "conveyor_settings", None) is not None else None


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = _conveyor_app(sender)
    if app is None:
        return
    try:
        ctx = worker_context(app)
        revision = prepare_database(ctx)
        log.info("conveyor worker: %s; schema %s", ctx.describe(), revision)
        pool = str(getattr(sender, "pool_cls", "") or app.conf.worker_pool)
        if "thread" in pool or "solo" in pool:
            ctx.host()
    except Exception as exc:  # noqa: BLE001 - refuse to start, saying why (no traceback)
        print(f"conveyor worker: cannot start: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = _conveyor_app(sender)
    if app is not None and id(app) not in _background:
        start_background(app)


def _on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    app = _conveyor_app(sender)
    if app is None:
        return
    for thread in _background.pop(id(app), []):
        thread.stop()
    ctx = _contexts.pop(id(app), None)
    if ctx is not None:
        ctx.close()


def connect_signals() -> None:
    global _connected
    with _lock:
        if _connected:
            return
        signals.worker_init.connect(_on_worker_init, weak=False)
        signals.worker_ready.connect(_on_worker_ready, weak=False)
        signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
        _connected = True
