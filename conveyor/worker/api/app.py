"""The HTTP API's ASGI app: ``create_app(settings)`` (what ``conveyor serve`` runs with uvicorn).

It serves OpenAI's Files and Batches APIs and the served models under ``/v1`` (each router in
its own module), ``/healthz``, ``/readyz`` and ``/metrics``, over the same database, object store and
broker as the workers (``conveyor.worker.api.services``). Errors are OpenAI's (``conveyor.worker.api.errors``),
but on Anthropic's Message Batches (``conveyor.worker.api.routes_message_batches``), which are Anthropic's.
While it runs, a background thread deletes files (uploads, batch outputs) past their ``expires_at``, counted in
``/metrics``, and another
takes broker submissions (``conveyor.worker.broker.submission_consumer``; ``CONVEYOR_API_TAKES_SUBMISSIONS``)
so that they become jobs, and demand an autoscaler sees, while no worker runs; a third publishes
the job-end announcements still due (``conveyor.worker.broker.announce``), which workers do as well;
a fourth fans out and delivers webhooks (``conveyor.worker.jobs.webhook_dispatch``), as workers do too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from conveyor.worker.api import (
    health,
    routes_batches,
    routes_files,
    routes_message_batches,
    routes_models,
    routes_webhooks,
)
from conveyor.worker.api.errors import install_error_handlers
from conveyor.worker.api.insecure_guard import InsecureGuard
from conveyor.worker.api.metrics_route import metrics_router
from conveyor.worker.api.services import ApiServices
from conveyor.worker.broker.announce import Announcer
from conveyor.worker.broker.submission_consumer import SubmissionConsumer
from conveyor.worker.core.periodic import Periodic
from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.files import delete_expired_files
from conveyor.worker.jobs.message_batch_archive import archive_due
from conveyor.worker.jobs.webhook_dispatch import WebhookDispatcher
from conveyor.worker.metrics.exposition import ApiMetrics

log = logging.getLogger(__name__)


EXPIRY_PAGE, EXPIRY_PAGES = 100, 20  # at most 2,000 files and 2,000 batches a pass


def _expire(services: ApiServices, metrics: ApiMetrics) -> None:
    """Delete the files past their ``expires_at`` and the Message Batch results past theirs,
    a page at a time while full pages come back."""
    keep = services.settings.message_batch_results_expire_after_seconds
    for _ in range(EXPIRY_PAGES):
        files = delete_expired_files(services.db, services.store, limit=EXPIRY_PAGE)
        metrics.files_expired(files)
        batches = archive_due(services.db, services.store, keep, limit=EXPIRY_PAGE)
        metrics.message_batches_archived(batches)
        if files.files < EXPIRY_PAGE and batches.batches < EXPIRY_PAGE:
            return


def create_app(
    settings: Settings,
    *,
    insecure: bool = False,
    services: ApiServices | None = None,
    extra_routers: Sequence[APIRouter] = (),
) -> FastAPI:
    """The API app. ``insecure``: no key is asked for (owner ``None``); ``conveyor serve``
    allows it on a loopback address only. ``extra_routers`` are included after the API's own."""
    services = services or ApiServices.open(settings, insecure=insecure)
    metrics = ApiMetrics(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        janitor = Periodic(
            "conveyor-expired-files",
            settings.expired_files_interval_seconds,
            lambda: _expire(services, metrics),
        ).start()
        dispatcher = WebhookDispatcher(services.db, settings, on_attempt=metrics.webhook_attempts)
        webhooks = Periodic("conveyor-webhooks", settings.webhook_poll_seconds, dispatcher.run_once).start()
        background = [janitor, webhooks]
        submissions = None
        if settings.api_takes_submissions:
            submissions = SubmissionConsumer(services.broker, services.db, services.store, settings).start()
            # The ends of submitted jobs that are still to be announced (a batch cancelled here,
            # say): workers publish them too, but none may be running.
            announcer = Announcer(services.broker, services.db, settings)
            background.append(
                Periodic("conveyor-announcements", settings.sweep_interval_seconds, announcer.announce_due).start()
            )
        try:
            yield
        finally:
            if submissions is not None:
                submissions.stop()
            for thread in background:
                thread.stop()
            dispatcher.close()
            metrics.close()
            services.close()

    app = FastAPI(
        title="Conveyor",
        summary="OpenAI-compatible Files and Batches API over Conveyor's workers",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.services = services
    install_error_handlers(app)
    for router in (routes_files.router, routes_batches.router, routes_models.router, health.router):
        app.include_router(router)
    app.include_router(routes_message_batches.router)
    for prefix in routes_webhooks.PREFIXES:
        app.include_router(routes_webhooks.router, prefix=prefix)
    app.include_router(metrics_router(metrics))
    for router in extra_routers:
        app.include_router(router)
    if services.insecure:
        app.add_middleware(InsecureGuard)
    return app
