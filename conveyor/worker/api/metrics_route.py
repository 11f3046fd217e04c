"""``GET /metrics``: the API process's Prometheus metrics (``conveyor.worker.metrics.exposition``):
jobs by status, and per model the demand (what an autoscaler reads, also while no worker
runs), the shards waiting and in flight and the live workers, read from the database with a
short cache. A scraper holds no API key: with ``CONVEYOR_METRICS_TOKEN`` set it must send
that token as a bearer token (Prometheus' ``authorization`` scrape option), else it gets a 401;
unset, the metrics are open (serve them where only the scraper can reach them)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from conveyor.worker.api.errors import ApiError
from conveyor.worker.metrics.exposition import ApiMetrics
from conveyor.worker.metrics.token import token_matches


def metrics_router(metrics: ApiMetrics) -> APIRouter:
    router = APIRouter()

    # A plain ``def``: the render may read the database, so it runs in the thread pool.
    @router.get("/metrics", include_in_schema=False)
    def get_metrics(request: Request) -> Response:
        if not token_matches(metrics.settings.metrics_token, request.headers.get("authorization")):
            raise ApiError(401, "The metrics need the scraper's token (CONVEYOR_METRICS_TOKEN) as a bearer token.",
                           code="invalid_metrics_token", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return router
