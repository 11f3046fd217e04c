"""What a Conveyor Celery app carries: its settings, model and queue, and (created once per
process, on first use) the worker context that tasks and background threads share.

It hangs on the app object (``app.conveyor``), so two apps in one process (tests, or a
client beside a worker) never share a context.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from conveyor.worker.broker.consumer_watch import ConsumerWatch
from conveyor.worker.core.periodic import Periodic
from conveyor.worker.core.settings import Settings
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.jobs.sweeper import Sweeper
from conveyor.worker.metrics.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclass
class AppState:
    settings: Settings
    model: str | None  # canonical; None for a client-only app (it only sends)
    queue: str
    background: list[Periodic] = field(default_factory=list)
    sweeper: Sweeper | None = None
    sweep_thread: Periodic | None = None
    registry_id: str | None = None  # this worker process's row in the workers registry
    metrics: WorkerMetrics | None = None  # its /metrics server, when CONVEYOR_METRICS_PORT is set
    intake_lane: Any = None  # its intake consumer (``conveyor.worker.broker.intake_lane``), once ready
    consumer: ConsumerWatch = field(default_factory=ConsumerWatch)  # Celery's consumer, as /readyz sees it
    _context: WorkerContext | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def context(self) -> WorkerContext:
        """The process's worker context (created once, on first use)."""
        if self._context is None:
            with self._lock:
                if self._context is None:
                    self._context = WorkerContext.create(self.settings, self.model)
        return self._context

    def broker_reconnected(self) -> None:
        """The consumer reconnected to the broker, which may have lost its messages (a
        Redis restarted without persistence): sweep for them now, not a lease period later."""
        if self.sweeper is None or self.sweep_thread is None:
            return
        log.warning("broker connection back: sweeping now for shards whose messages it lost")
        self.sweeper.after_broker_reconnect()
        self.sweep_thread.wake()

    def close(self) -> None:
        for thread in self.background:
            thread.stop()
        self.background.clear()
        self.sweeper = self.sweep_thread = None
        if self.intake_lane is not None:
            self.intake_lane.stop()
            self.intake_lane = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        with self._lock:
            ctx, self._context = self._context, None
        if ctx is not None:
            ctx.close()


def app_state(app: Any) -> AppState | None:
    """The Conveyor state of a Celery app, or None for any other app."""
    state = getattr(app, "conveyor", None)
    return state if isinstance(state, AppState) else None


def require_state(app: Any) -> AppState:
    state = app_state(app)
    if state is None:
        raise RuntimeError("not a Conveyor Celery app (build it with conveyor.worker.broker.app.create_app)")
    return state
