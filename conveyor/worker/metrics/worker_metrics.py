"""A worker process's metrics: what its shards stored (``item_metrics``), its engine now
(``engine_collector``), its cold start (``cold_start_collector``), its shard turns' affinity
hits (``affinity_collector``), the database's jobs and
shards (``db_collector``), and the process itself (CPU, memory, file descriptors, GC), in
one registry, served at ``/metrics`` while ``CONVEYOR_METRICS_PORT`` is set (``conveyor
worker --metrics-port``), beside the process's ``/healthz`` and ``/readyz``
(``WorkerContext.liveness`` and ``readiness``).

One worker process holds one engine and runs its shard tasks on threads (Celery's threads
pool), so one process's registry sees all its work. A multi-process pool (prefork) would
split the work over children the server cannot see: the worker refuses to serve metrics
with one (``broker/worker_process.py``).
"""

from __future__ import annotations

from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.jobs.catalog import declared_models
from conveyor.worker.metrics.affinity_collector import AffinityCollector
from conveyor.worker.metrics.cold_start_collector import ColdStartCollector
from conveyor.worker.metrics.db_collector import DatabaseCollector, metrics_db_engine
from conveyor.worker.metrics.engine_collector import EngineCollector
from conveyor.worker.metrics.fair_share_collector import FairShareCollector
from conveyor.worker.metrics.item_metrics import ItemMetrics
from conveyor.worker.metrics.registry import new_registry
from conveyor.worker.metrics.server import MetricsServer
from conveyor.worker.metrics.webhook_metrics import WebhookAttempts


class WorkerMetrics:
    """The metrics of the worker process that holds ``ctx``; ``serve`` also starts the
    ``/metrics`` server. ``close`` stops observing and serving."""

    def __init__(self, ctx: WorkerContext) -> None:
        s = ctx.settings
        self.ctx = ctx
        self.registry = new_registry()
        self.items = ItemMetrics(self.registry, ctx.model)
        self.registry.register(EngineCollector(ctx.host_stats, ctx.model))
        self.registry.register(FairShareCollector(ctx.host_stats, ctx.model))
        self.registry.register(ColdStartCollector(lambda: ctx.cold_start, ctx.model))
        self.registry.register(AffinityCollector(ctx.affinity, ctx.model))
        self._db = metrics_db_engine(s.database)
        self.registry.register(
            DatabaseCollector(
                self._db,
                live_seconds=s.worker_live_seconds,
                cache_seconds=s.metrics_cache_seconds,
                models=[ctx.model, *declared_models(s)],
            )
        )
        ctx.item_listeners.append(self.items.observe)
        self.webhook_attempts = WebhookAttempts(self.registry)
        self.server: MetricsServer | None = None

    @classmethod
    def serve(cls, ctx: WorkerContext, host: str, port: int) -> WorkerMetrics:
        metrics = cls(ctx)
        try:
            metrics.server = MetricsServer(
                metrics.registry, host, port, liveness=ctx.liveness, readiness=ctx.readiness,
                token=ctx.settings.metrics_token,
            )  # fmt: skip
        except Exception:
            metrics.close()
            raise
        return metrics

    @property
    def port(self) -> int | None:
        """The port ``/metrics`` is served on (None when not serving)."""
        return self.server.port if self.server is not None else None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.items.observe in self.ctx.item_listeners:
            self.ctx.item_listeners.remove(self.items.observe)
        self._db.dispose()
