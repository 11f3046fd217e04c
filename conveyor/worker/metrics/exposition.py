"""The API server's ``/metrics``, framework-agnostic: bytes and a content type.

The API process runs no engine and stores no items, so its metrics are the database's
(``db_collector``: jobs by status; per model the demand, the shards waiting and in flight,
the jobs waiting and the live workers; the catalog's models always) plus the process's own.
Mount it in FastAPI as a plain ``def`` route (the read blocks on the database, so it runs in
the thread pool, not on the event loop)::

    from fastapi import FastAPI, Request, Response
    from conveyor.worker.metrics.exposition import ApiMetrics

    metrics = ApiMetrics(settings)            # once, at start-up; metrics.close() at shutdown

    @app.get("/metrics", include_in_schema=False)
    def get_metrics(request: Request) -> Response:
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

``metrics.registry`` takes the API's own metrics too: the files its expiry sweep deleted
(``conveyor_files_expired_total``, ``conveyor_files_expired_bytes_total``) and the Message
Batches whose results it archived (``conveyor_message_batches_archived_total``, ``..._bytes_total``).
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import Counter
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.catalog import declared_models
from conveyor.worker.jobs.files import ExpiredFiles
from conveyor.worker.jobs.message_batch_archive import ArchivedBatches
from conveyor.worker.metrics.db_collector import DatabaseCollector, metrics_db_engine
from conveyor.worker.metrics.registry import new_registry
from conveyor.worker.metrics.webhook_metrics import WebhookAttempts


class MetricsPayload(NamedTuple):
    body: bytes
    content_type: str


def render(registry: CollectorRegistry, accept: str | None = None) -> MetricsPayload:
    """``registry`` in the format the scraper's ``Accept`` header asks for: OpenMetrics if it
    asks for it, else Prometheus' text format 0.0.4."""
    encoder, content_type = choose_encoder(accept or "")
    return MetricsPayload(encoder(registry), content_type)


class ApiMetrics:
    """The metrics of an API server process: the database's counts and the process's."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = new_registry()
        self._db = metrics_db_engine(settings.database)
        self.registry.register(
            DatabaseCollector(
                self._db,
                live_seconds=settings.worker_live_seconds,
                cache_seconds=settings.metrics_cache_seconds,
                models=declared_models(settings),
            )
        )

        self._expired_files = Counter(
            "conveyor_files_expired",
            "Files (uploads, batch outputs) deleted by this API process because they passed their expires_at.",
            registry=self.registry,
        )
        self._expired_bytes = Counter(
            "conveyor_files_expired_bytes",
            "Bytes of the files this API process deleted because they passed their expires_at.",
            registry=self.registry,
        )

        self.webhook_attempts = WebhookAttempts(self.registry)
        self._archived_batches = Counter(
            "conveyor_message_batches_archived",
            "Message Batches whose results this API process deleted because they passed their retention.",
            registry=self.registry,
        )
        self._archived_bytes = Counter(
            "conveyor_message_batches_archived_bytes",
            "Bytes of the Message Batch results this API process deleted because they passed their retention.",
            registry=self.registry,
        )

    def message_batches_archived(self, gone: ArchivedBatches) -> None:
        """Count what one pass of the Message Batch archive deleted."""
        self._archived_batches.inc(gone.batches)
        self._archived_bytes.inc(gone.bytes)

    def files_expired(self, gone: ExpiredFiles) -> None:
        """Count what one pass of the expiry sweep deleted."""
        self._expired_files.inc(gone.files)
        self._expired_bytes.inc(gone.bytes)

    def render(self, accept: str | None = None) -> MetricsPayload:
        return render(self.registry, accept)

    def close(self) -> None:
        self._db.dispose()
