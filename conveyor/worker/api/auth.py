"""Who is calling: ``Authorization: Bearer <key>`` checked against the stored key hashes.

Every route under ``/v1`` depends on ``require_owner``, which gives the owner of what the
request creates and may see: the key's id. A missing or unknown (or revoked) key is a 401 in
OpenAI's words, before the request's body is read. A server started with
``--insecure-no-auth`` (loopback only) takes no key: its owner is ``None``. Keys are never
logged nor echoed back. A key verified in the last 2 seconds is taken without a database read
(``KeyVerifier.cached``): a revoked key stops opening anything within those seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from conveyor.worker.api.errors import ApiError
from conveyor.worker.api.services import Services

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


@dataclass(frozen=True)
class Owner:
    """The caller: ``id`` is its API key's id (``None`` on an insecure server)."""

    id: str | None


async def require_owner(request: Request, services: Services) -> Owner:
    if services.insecure:
        return Owner(None)
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(
            401,
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY). Create one with `conveyor keys create NAME`.",
            headers=_CHALLENGE,
        )
    # A key verified a moment ago needs no database read (nor a thread to wait for one).
    key_id = services.verifier.cached(key) or await run_in_threadpool(services.verifier.verify, key)
    if key_id is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key", headers=_CHALLENGE)
    return Owner(key_id)


Caller = Annotated[Owner, Depends(require_owner)]
