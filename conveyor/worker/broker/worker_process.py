"""A worker process's life around the Celery consumer (Celery's signals, for Conveyor apps).

- ``worker_init``: start the ``/metrics``, ``/healthz`` and ``/readyz`` server when
  ``CONVEYOR_METRICS_PORT`` is set (so probes get answers from the start), refuse to start
  on a bad configuration or an outdated database schema (the message says what to run),
  record the worker in the registry (``starting``), then load the model
  (threads/solo pools: once, before consuming; a prefork child loads its own on first use).
  A model that cannot load exits 1 before any message is taken, recorded ``failed`` with
  the reason, so nothing counts it as serving the model.
- ``worker_ready``: mark the worker ``ready``; start its registry heartbeat, the sweeper,
  the expiry (jobs of any model past their completion window), the announcements (jobs of
  any model whose end is still to be announced on the broker: ``conveyor.worker.broker.announce``),
  the webhooks (every job's events: ``conveyor.worker.jobs.webhook_dispatch``)
  and the engine-snapshot threads, the intake lane (``conveyor.worker.broker.intake_lane``: intakes on
  a consumer of their own, never behind shards), and with ``--exit-when-idle`` the idle watch. ``/readyz``
  answers 200 from here on (``WorkerContext.readiness``).
- ``worker_shutting_down`` (SIGTERM or Ctrl-C: Celery's warm shutdown, which stops consuming
  and waits for running tasks): the process starts draining (``ProcessState.begin_drain``):
  running shards finish until the hand-back time, then give back what is left (their
  leases released) so the tasks end within ``--drain-timeout``, and Celery exits 0. The
  idle watch ends an idle worker the same way, by sending the process SIGTERM.
- ``worker_shutdown``: stop them and the engine host; mark the worker ``stopped``. A teardown
  still running at the drain deadline is cut short there: the process exits 0 on time.

And two consumer bootsteps: ``WatchConsumer`` gives each (re)connected consumer to the
app's ``ConsumerWatch`` (``/readyz`` says when the worker consumes nothing it should; a lost
connection met by an ack restarts the consumer: ``conveyor.worker.broker.consumer_watch``), and
``BrokerReconnected``: each time the consumer connects to the broker again after losing it,
the sweeper runs at once (``AppState.broker_reconnected``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from celery import Celery, bootsteps, signals

from conveyor.worker.broker.announce import Announcer
from conveyor.worker.broker.app_state import AppState, app_state
from conveyor.worker.broker.intake_lane import IntakeLane
from conveyor.worker.broker.queues import enqueue_finalize, enqueue_intake, enqueue_shards, queue_depth
from conveyor.worker.core.periodic import Periodic
from conveyor.worker.core.settings import ConfigError
from conveyor.worker.execution.process_state import Drain, Phase, ProcessState
from conveyor.worker.execution.snapshots import SnapshotWriter
from conveyor.worker.jobs.expiry import expire_due_jobs
from conveyor.worker.jobs.storage_sweep import StorageSweeper
from conveyor.worker.jobs.sweeper import Sweeper
from conveyor.worker.jobs.webhook_dispatch import WebhookDispatcher
from conveyor.worker.metrics.worker_metrics import WorkerMetrics
from conveyor.worker.store.models import WorkerState
from conveyor.worker.store.schema import ensure_schema
from conveyor.worker.store.workers import prune_workers, register_worker, set_worker_state

log = logging.getLogger(__name__)

_lock = threading.Lock()
_connected = False
# The Conveyor app state of the worker this process runs (one per process): Celery's
# ``worker_shutting_down`` names the worker by hostname only.
_running: AppState | None = None


def start_background(app: Celery, state: AppState) -> list[Periodic]:
    ctx = state.context()
    s = ctx.settings
    queue = state.queue
    sweeper = Sweeper(
        ctx.db,
        ctx.model,
        s,
        enqueue_shard=lambda job_id, index: enqueue_shards(app, queue, job_id, [index]),
        enqueue_finalize=lambda job_id, redo: enqueue_finalize(app, queue, job_id, redo),
        queue_depth=lambda: queue_depth(app, queue),
        enqueue_intake=lambda job_id: enqueue_intake(app, job_id, s.queue_prefix),
    )
    state.sweeper = sweeper
    ctx.consumer_problem = state.consumer.problem
    state.sweep_thread = Periodic("conveyor-sweeper", s.sweep_interval_seconds, sweeper.sweep_once).start()
    state.intake_lane = IntakeLane(app, ctx).start()
    state.background = []
    registry_id = state.registry_id
    if registry_id is not None:
        set_worker_state(ctx.db, registry_id, WorkerState.ready)
        beat = Periodic("conveyor-registry", s.heartbeat_seconds, lambda: set_worker_state(ctx.db, registry_id))
        state.background.append(beat.start())
    announcer = Announcer(app, ctx.db, s)
    storage = StorageSweeper(ctx.db, ctx.store, grace_seconds=s.storage_grace_seconds)

    def expire() -> None:
        for job_id in expire_due_jobs(ctx.db, ctx.store, heartbeat_seconds=s.heartbeat_seconds):
            announcer.announce(job_id)  # when it ended at once (no shard was running)

    on_attempt = state.metrics.webhook_attempts if state.metrics is not None else None
    webhooks = WebhookDispatcher(ctx.db, s, on_attempt=on_attempt)
    state.background += [
        state.sweep_thread,
        Periodic("conveyor-webhooks", s.webhook_poll_seconds, webhooks.run_once).start(),
        Periodic("conveyor-snapshots", s.snapshot_interval_seconds, SnapshotWriter(ctx).write_once).start(),
        Periodic("conveyor-expiry", s.sweep_interval_seconds, expire).start(),
        Periodic("conveyor-announcements", s.sweep_interval_seconds, announcer.announce_due).start(),
        Periodic("conveyor-storage-sweep", s.sweep_interval_seconds, storage.sweep_once).start(),
        Periodic("conveyor-registry-prune", 3600.0, lambda: prune_workers(ctx.db, s.worker_retention_seconds)).start(),
    ]
    idle = s.exit_when_idle_seconds
    if idle is not None:
        state.background.append(Periodic("conveyor-idle", min(1.0, idle / 4), _IdleWatch(state, idle)).start())
    return state.background


class _IdleWatch:
    """With ``--exit-when-idle``: once no task has run for ``seconds``, stop the worker the way
    Kubernetes would (SIGTERM: a drain with nothing to drain, then exit 0)."""

    def __init__(self, state: AppState, seconds: float) -> None:
        self._state, self._seconds, self._sent = state, seconds, False

    def __call__(self) -> None:
        process = self._state.context().state
        if self._sent or process.draining or process.idle_seconds() < self._seconds:
            return
        self._sent = True
        log.info("conveyor worker: no task for %.0f s (--exit-when-idle): stopping", self._seconds)
        os.kill(os.getpid(), signal.SIGTERM)


class BrokerReconnected(bootsteps.StartStopStep):
    """A consumer bootstep: Celery starts it each time the consumer (re)connects, after the
    consumer is consuming again; from the second time on, the broker was lost and is back."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        if getattr(c, "restart_count", 0) > 0:
            state = app_state(c.app)
            if state is not None:
                state.broker_reconnected()


class WatchConsumer(bootsteps.StartStopStep):
    """A consumer bootstep: started each time the consumer (re)connects, stopped when it loses
    its connection or the worker stops."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        state = app_state(c.app)
        if state is not None:
            state.consumer.started(c)

    def stop(self, c: Any) -> None:
        state = app_state(c.app)
        if state is not None:
            state.consumer.stopped()


def add_consumer_steps(app: Celery) -> None:
    app.steps["consumer"].add(WatchConsumer)
    app.steps["consumer"].add(BrokerReconnected)


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    state = app_state(app)
    if app is None or state is None:
        return
    global _running
    _running = state
    setup_logging = getattr(sender, "setup_logging", None)
    if callable(setup_logging):  # Celery would set logging up only after this signal: the
        setup_logging()  # checks and the model load below would log into the void (a no-op later)
    try:
        ctx = state.context()
        pool = str(getattr(sender, "pool_cls", "") or app.conf.worker_pool)
        if ctx.settings.metrics_port:
            _serve_metrics(state, pool)
        revision = ensure_schema(ctx.settings, ctx.db)
        state.registry_id = register_worker(ctx.db, ctx.model, state.queue, checkpoint=ctx.checkpoint)
        ctx.store.check()  # a worker that cannot store results must not take shards
        log.info("conveyor worker: %s on queue %s; schema %s", ctx.describe(), state.queue, revision)
        ctx.state.advance(Phase.loading)
        if "thread" in pool or "solo" in pool:
            ctx.host()
    except Exception as exc:
        print(f"conveyor worker: cannot start: {exc}", file=sys.stderr, flush=True)
        _record_failure(state, f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None


def _serve_metrics(state: AppState, pool: str) -> None:
    """Start the process's ``/metrics`` server. Its counters see one process's work, so a
    pool of several processes (prefork) is refused rather than reported in part."""
    s = state.settings
    if "prefork" in pool:  # (Celery takes --pool=prefork for "the default": ours is threads)
        raise ConfigError(
            "CONVEYOR_METRICS_PORT needs a single-process pool (threads, the default, or solo): "
            "a prefork pool's children do their work where the metrics server cannot count it"
        )
    try:
        state.metrics = WorkerMetrics.serve(state.context(), s.metrics_host, s.metrics_port)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {s.metrics_host}:{s.metrics_port} (CONVEYOR_METRICS_PORT): {exc}"
        ) from None


def _record_failure(state: AppState, reason: str) -> None:
    """Mark the worker ``failed`` (best effort: the database may be what failed)."""
    if state.registry_id is None:
        return
    try:
        set_worker_state(state.context().db, state.registry_id, WorkerState.failed, error=reason)
    except Exception:
        log.warning("could not record the failed start in the workers registry", exc_info=True)


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    state = app_state(app)
    if state is not None:
        state.context().mark_ready()  # logs the cold start, which /metrics exports from now on
        state.context().state.advance(Phase.ready)
    if state is not None and not state.background:
        start_background(app, state)
    if state is not None and state.metrics is not None:
        s = state.context().settings
        log.info("conveyor worker: metrics at http://%s:%s/metrics", s.metrics_host, state.metrics.port)


def _on_worker_shutting_down(sig: Any = None, how: Any = None, **_: Any) -> None:
    """Celery got a stop signal (in its signal handler, on the main thread). A warm shutdown
    waits for running tasks: bound that wait by draining. (A cold one exits at once; its
    leases expire and the shards are taken over as after a crash.)"""
    state = _running
    if state is None or how != "Warm":
        return
    ctx = state.context()
    if ctx.state.draining:  # Celery may say so more than once
        return
    timeout = ctx.settings.drain_timeout_seconds
    drain = ctx.state.begin_drain(timeout, reason=str(sig))
    if state.intake_lane is not None:  # no new intake either (the one running finishes or hands back)
        state.intake_lane.should_stop = True
    log.warning(
        "conveyor worker: stopping (%s): taking no new shard; running shards hand back what is left "
        "in %.0f s; exiting within %.0f s (--drain-timeout)",
        sig, drain.hand_back_at - drain.started_at, timeout,
    )  # fmt: skip
    threading.Thread(
        target=_exit_by_deadline, args=(ctx.state, drain), name="conveyor-drain-deadline", daemon=True
    ).start()


def _exit_by_deadline(state: ProcessState, drain: Drain) -> None:
    """Keep the promise of ``--drain-timeout`` (Kubernetes' grace period is sized from it). By
    the deadline the shards have handed back and released their leases; what may still run is
    Celery's and the engine's teardown, which a loaded machine can stretch for seconds: the
    process ends here instead (0: nothing was lost). A task still releasing gets one more
    margin, as long as the hand-back had, so a lease is not left to expire for want of a commit."""
    time.sleep(max(0.0, drain.deadline - time.monotonic()))
    last_chance = drain.deadline + (drain.deadline - drain.hand_back_at)
    while state.running_tasks and time.monotonic() < last_chance:
        time.sleep(0.05)
    log.warning("conveyor worker: the drain timeout has passed; exiting now, before the rest of the teardown")
    logging.shutdown()  # flush the log handlers: os._exit skips them
    os._exit(0)


def _on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    state = app_state(getattr(sender, "app", None))
    if state is None:
        return
    state.context().state.advance(Phase.stopped)
    for thread in state.background:  # the registry heartbeat must not beat after `stopped`
        thread.stop()
    if state.registry_id is not None:
        try:
            set_worker_state(state.context().db, state.registry_id, WorkerState.stopped)
        except Exception:
            log.warning("could not record the stop in the workers registry", exc_info=True)
    state.close()


def connect_signals() -> None:
    """Connect the handlers once per process; they act only on Conveyor apps."""
    global _connected
    with _lock:
        if _connected:
            return
        signals.worker_init.connect(_on_worker_init, weak=False)
        signals.worker_ready.connect(_on_worker_ready, weak=False)
        signals.worker_shutting_down.connect(_on_worker_shutting_down, weak=False)
        signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
        _connected = True
