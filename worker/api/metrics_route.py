"""``GET /metrics``: the API process's Prometheus metrics (``worker.metrics.exposition``):
jobs by status, and per model the demand (what an autoscaler reads, also while no worker
runs), the shards waiting and in flight and the live workers, read from the database with a
short cache. Open like ``/healthz``: a scraper holds no API key, and the numbers name no
user's data."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from worker.metrics.exposition import ApiMetrics


def metrics_router(metrics: ApiMetrics) -> APIRouter:
    router = APIRouter()

    # A plain ``def``: the render may read the database, so it runs in the thread pool.
    @router.get("/metrics", include_in_schema=False)
    def get_metrics(request: Request) -> Response:
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return router
