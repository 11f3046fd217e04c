"""The settings of the metrics server."""

from __future__ import annotations

from pydantic import BaseModel, Field


class MetricsSettings(BaseModel):
    """Metrics.

    The Prometheus servers of workers and the API, and who may scrape them.
    """

    # The port of a worker's Prometheus ``/metrics``, ``/healthz`` and ``/readyz`` (0: no metrics server).
    metrics_port: int = Field(0, ge=0, le=65535)
    # When set, every ``/metrics`` (the API's and the workers') answers only a scraper sending
    # ``Authorization: Bearer <this token>``; unset, they are open to whoever reaches the port.
    metrics_token: str | None = Field(None, min_length=16)
    # The address the metrics server listens on (all interfaces, for a scraper outside the container).
    metrics_host: str = "0.0.0.0"
    # Job and shard counts are read from the database at most once per this long per process.
    metrics_cache_seconds: float = Field(5.0, ge=0)
