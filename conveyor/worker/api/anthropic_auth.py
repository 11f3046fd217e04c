"""Who is calling Anthropic's routes: the API key as ``x-api-key`` (Anthropic's header) or
``Authorization: Bearer`` (which the ``anthropic`` SDK may send instead), checked as every other
route's key is (``conveyor.worker.api.auth``). ``anthropic-version`` is accepted whatever it
says, and ``anthropic-beta`` ignored: one version of the batch API is served."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from conveyor.worker.api.auth import Owner
from conveyor.worker.api.errors import ApiError
from conveyor.worker.api.services import Services


def presented_key(request: Request) -> str:
    key = request.headers.get("x-api-key", "").strip()
    if key:
        return key
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    return bearer.strip() if scheme.lower() == "bearer" else ""


async def require_key_holder(request: Request, services: Services) -> Owner:
    if services.insecure:
        return Owner(None)
    key = presented_key(request)
    if not key:
        raise ApiError(
            401,
            "x-api-key header is required (or Authorization: Bearer YOUR_KEY). Create a key with "
            "`conveyor keys create NAME`.",
        )
    key_id = services.verifier.cached(key) or await run_in_threadpool(services.verifier.verify, key)
    if key_id is None:
        raise ApiError(401, "invalid x-api-key")
    return Owner(key_id)


KeyHolder = Annotated[Owner, Depends(require_key_holder)]
