"""Metrics read from the database at scrape time: jobs by status and, per model, the work that
needs a worker (its demand), the shards waiting and in flight, and the live workers.

The demand is what an autoscaler scales on. A broker's queue length cannot see the messages
workers have taken but not acknowledged (every running shard: ``acks_late``), nor a shard
whose worker died, nor a job that has no shard yet; the database knows them all:

- waiting: shards of unfinished jobs that no live worker holds: ``pending``, or ``running``
  under an expired lease (its worker died; the sweeper hands it back);
- in flight: shards ``running`` under a live lease;
- jobs waiting: unfinished jobs with no shard waiting or in flight, each counted once: a
  batch in ``validating`` (an uploaded file or a broker submission whose intake no worker
  has run yet) and a job whose finalisation is due or stalled. Work that came by any door
  is here before any worker runs: ``conveyor submit`` ingests in its own process, the API
  records a batch ``validating``, and the API server takes broker submissions too
  (``conveyor.worker.broker.submission_consumer``);
- demand: the three added up.

Scale on ``conveyor_demand``, taking ``max`` rather than ``sum`` across scrape targets:
every worker and the API report the same database-wide numbers. The models of the
deployment's catalog (``CONVEYOR_MODELS``) are always reported, 0 when idle, so a trigger
reads a number, not nothing, before any work came. A brief database outage removes these
series (``conveyor_metrics_database_up`` is 0 meanwhile): an autoscaler's query can ride it
out with ``max_over_time(...[2m])``.

Webhook deliveries are counted by status (``conveyor_webhook_deliveries``): ``failed`` ones
gave up after their retries (``conveyor webhooks --status failed`` lists them).

Each read is five grouped queries over indexed columns (the shard query only touches
pending and running shards, the jobs query only unfinished jobs), under a statement timeout
on PostgreSQL, and is cached for ``cache_seconds``: many scrapes at once make one read. A
failed read (the database down, the schema missing) never fails the scrape.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import case, exists, func, select
from sqlalchemy.engine import Engine

from conveyor.worker.store.database import create_db_engine, normalize_url
from conveyor.worker.store.models import (
    Job,
    JobStatus,
    Shard,
    ShardStatus,
    WebhookDelivery,
    WebhookDeliveryStatus,
    Worker,
    WorkerState,
    now,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 5.0  # under Prometheus' default scrape timeout (10 s)
MAX_MODELS = 256  # models remembered (reported at 0 once their work is done)

_UNFINISHED = [s for s in JobStatus if not s.terminal]
_ACTIVE_SHARD = (ShardStatus.pending, ShardStatus.running)
# Jobs a worker must still take up: intake (validating), finalisation (in progress with no
# shard left, or finalizing). A cancelling job is finished by whoever cancelled it.
_JOB_WORK = (JobStatus.validating, JobStatus.in_progress, JobStatus.finalizing)


def metrics_db_engine(url: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> Engine:
    """An engine for metrics reads only: its own small pool, so a scrape never waits behind
    a worker's shards for a connection, and a connect timeout, so a database that does not
    answer fails the read in seconds rather than hanging the scrape."""
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        return create_db_engine(u)
    return create_db_engine(
        u,
        pool_size=1,
        max_overflow=1,
        pool_timeout=timeout_seconds,
        connect_args={"connect_timeout": max(2, math.ceil(timeout_seconds))},
    )


@dataclass(frozen=True)
class DatabaseCounts:
    jobs: dict[str, int]  # status -> jobs
    waiting: dict[str, int]  # model -> shards
    in_flight: dict[str, int]  # model -> shards
    workers: dict[str, int]  # model -> live workers
    jobs_waiting: dict[str, int] = field(default_factory=dict)  # model -> jobs with no active shard
    webhooks: dict[str, int] = field(default_factory=dict)  # delivery status -> webhook deliveries

    def demand(self, model: str) -> int:
        """Work that needs a worker of ``model``: shards waiting or in flight, jobs waiting."""
        return self.waiting.get(model, 0) + self.in_flight.get(model, 0) + self.jobs_waiting.get(model, 0)


def read_counts(db: Engine, *, live_seconds: float, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> DatabaseCounts:
    """One consistent read of the counts (a worker is live while ``ready`` with a heartbeat
    at most ``live_seconds`` old, as ``store/workers.py`` says)."""
    t = now()
    leased = (Shard.status == ShardStatus.running) & (Shard.lease_expires_at > t)
    state = case((leased, "in_flight"), else_="waiting").label("state")
    with db.begin() as conn:
        if conn.dialect.name == "postgresql":
            ms = str(max(1, int(timeout_seconds * 1000)))
            conn.execute(select(func.set_config("statement_timeout", ms, True)))  # this transaction only
        jobs = conn.execute(select(Job.status, func.count()).group_by(Job.status)).all()
        shards = conn.execute(
            select(Job.model, state, func.count())
            .select_from(Shard)
            .join(Job, Job.id == Shard.job_id)
            .where(Shard.status.in_(_ACTIVE_SHARD), Job.status.in_(_UNFINISHED))
            .group_by(Job.model, state)
        ).all()
        active = exists().where(Shard.job_id == Job.id, Shard.status.in_(_ACTIVE_SHARD))
        jobs_waiting = conn.execute(
            select(Job.model, func.count()).where(Job.status.in_(_JOB_WORK), ~active).group_by(Job.model)
        ).all()
        workers = conn.execute(
            select(Worker.model, func.count())
            .where(Worker.state == WorkerState.ready, Worker.heartbeat_at >= t - live_seconds)
            .group_by(Worker.model)
        ).all()
        webhooks = conn.execute(select(WebhookDelivery.status, func.count()).group_by(WebhookDelivery.status)).all()
    waiting: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    for model, kind, count in shards:
        (in_flight if kind == "in_flight" else waiting)[model] = int(count)
    return DatabaseCounts(
        jobs={JobStatus(status).value: int(count) for status, count in jobs},
        waiting=waiting,
        in_flight=in_flight,
        workers={model: int(count) for model, count in workers},
        jobs_waiting={model: int(count) for model, count in jobs_waiting},
        webhooks={WebhookDeliveryStatus(status).value: int(count) for status, count in webhooks},
    )


class DatabaseCollector(Collector):
    """The database's counts as Prometheus gauges, read at most once per ``cache_seconds``.

    ``models`` are always reported (the catalog, a worker's own model), as is every model seen
    since this collector started (up to ``MAX_MODELS``): a drained queue reads 0, not nothing."""

    def __init__(
        self,
        db: Engine,
        *,
        live_seconds: float,
        cache_seconds: float = 5.0,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        models: Iterable[str] = (),
    ) -> None:
        self._db = db
        self._live_seconds = live_seconds
        self._cache_seconds = cache_seconds
        self._timeout_seconds = timeout_seconds
        self._models: set[str] = set(models)
        self._lock = threading.Lock()  # one read at a time; the scrapes waiting on it get its result
        self._read_at = -math.inf
        self._families: list[Metric] = []
        self._up = True  # what the last read found (to log each change once)

    def describe(self) -> Iterator[Metric]:
        yield from self._build(None, 0.0)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if time.monotonic() - self._read_at >= self._cache_seconds:
                self._families = self._read()
                self._read_at = time.monotonic()
            families = self._families
        yield from families

    def _read(self) -> list[Metric]:
        start = time.perf_counter()
        try:
            counts = read_counts(self._db, live_seconds=self._live_seconds, timeout_seconds=self._timeout_seconds)
        except Exception as exc:
            if self._up:
                log.warning("metrics: cannot read the database (reported as conveyor_metrics_database_up 0): %s", exc)
            self._up = False
            return self._build(None, time.perf_counter() - start)
        if not self._up:
            log.warning("metrics: the database can be read again")
        self._up = True
        return self._build(counts, time.perf_counter() - start)

    def _build(self, counts: DatabaseCounts | None, seconds: float) -> list[Metric]:
        up = GaugeMetricFamily(
            "conveyor_metrics_database_up", "1 if the last read of the database for metrics succeeded, else 0."
        )
        up.add_metric([], 1.0 if counts is not None else 0.0)
        took = GaugeMetricFamily(
            "conveyor_metrics_database_read_seconds", "How long the last read of the database for metrics took."
        )
        took.add_metric([], seconds)
        jobs = GaugeMetricFamily("conveyor_jobs", "Jobs by status.", labels=["status"])
        waiting = GaugeMetricFamily(
            "conveyor_shards_waiting",
            "Shards of unfinished jobs that no live worker holds (pending, or under an expired lease).",
            labels=["model"],
        )
        in_flight = GaugeMetricFamily(
            "conveyor_shards_in_flight", "Shards running under a live worker's lease.", labels=["model"]
        )
        workers = GaugeMetricFamily(
            "conveyor_workers_live", "Workers serving the model (ready, with a recent heartbeat).", labels=["model"]
        )
        jobs_waiting = GaugeMetricFamily(
            "conveyor_jobs_waiting",
            "Unfinished jobs with no shard waiting or in flight: intake (validating) or finalisation due.",
            labels=["model"],
        )
        demand = GaugeMetricFamily(
            "conveyor_demand",
            "Work that needs a worker of the model: shards waiting or in flight, plus jobs waiting (what to scale on).",
            labels=["model"],
        )
        webhooks = GaugeMetricFamily(
            "conveyor_webhook_deliveries",
            "Webhook deliveries by status: pending (to be tried, or retried), delivered, failed (given up).",
            labels=["status"],
        )
        if counts is not None:
            for delivery in WebhookDeliveryStatus:
                webhooks.add_metric([delivery.value], float(counts.webhooks.get(delivery.value, 0)))
            for status in JobStatus:
                jobs.add_metric([status.value], float(counts.jobs.get(status.value, 0)))
            for model in sorted(self._remember(counts)):
                waiting.add_metric([model], float(counts.waiting.get(model, 0)))
                in_flight.add_metric([model], float(counts.in_flight.get(model, 0)))
                workers.add_metric([model], float(counts.workers.get(model, 0)))
                jobs_waiting.add_metric([model], float(counts.jobs_waiting.get(model, 0)))
                demand.add_metric([model], float(counts.demand(model)))
        return [up, took, jobs, waiting, in_flight, workers, jobs_waiting, demand, webhooks]

    def _remember(self, counts: DatabaseCounts) -> set[str]:
        present = set(counts.waiting) | set(counts.in_flight) | set(counts.workers) | set(counts.jobs_waiting)
        for model in sorted(present - self._models):
            if len(self._models) >= MAX_MODELS:
                break
            self._models.add(model)
        return self._models | present
