"""``/healthz`` (the process answers) and ``/readyz`` (the database, the broker and the object
store can be reached now). Neither needs a key: a load balancer or Kubernetes probes them.
Without a key ``/readyz`` says only ``ready`` or ``unavailable``; each check's answer (which
can name a service's host and port) is for a caller with a valid API key.

``/readyz`` runs its three checks in threads, each bounded in time, and keeps the answer for
``READY_CACHE_SECONDS`` so a storm of probes costs one round of checks.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from conveyor.worker.api.services import ApiServices, Services
from conveyor.worker.broker.queues import check_broker

router = APIRouter(tags=["health"])

CHECK_TIMEOUT_SECONDS = 10.0
READY_CACHE_SECONDS = 2.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _database(services: ApiServices) -> None:
    with services.db.connect() as conn:
        conn.execute(text("SELECT 1"))


def _store(services: ApiServices) -> None:
    services.store.check()


def _broker(services: ApiServices) -> None:
    check_broker(services.broker)


_CHECKS = {"database": _database, "broker": _broker, "storage": _store}


async def _check(services: ApiServices, name: str) -> str:
    try:
        await asyncio.wait_for(run_in_threadpool(_CHECKS[name], services), CHECK_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        return f"no answer in {CHECK_TIMEOUT_SECONDS:g} s"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:500]
    return "ok"


async def _may_see_detail(request: Request, services: ApiServices) -> bool:
    if services.insecure:
        return True
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return False
    key = key.strip()
    return (services.verifier.cached(key) or await run_in_threadpool(services.verifier.verify, key)) is not None


@router.get("/readyz")
async def readyz(request: Request, services: Services) -> JSONResponse:
    cached = services.ready
    if cached is None or time.monotonic() - cached[0] > READY_CACHE_SECONDS:
        names = list(_CHECKS)
        results = await asyncio.gather(*(_check(services, name) for name in names))
        checks = dict(zip(names, results, strict=True))
        ready = all(r == "ok" for r in results)
        cached = (time.monotonic(), {"status": "ready" if ready else "unavailable", "checks": checks})
        services.ready = cached
    body = cached[1]
    status = 200 if body["status"] == "ready" else 503
    return JSONResponse(body if await _may_see_detail(request, services) else {"status": body["status"]}, status)
