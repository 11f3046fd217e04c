"""``/v1/webhooks``: an API key's own webhook endpoints, in OpenAI's shape, also at
``/v1/webhook_endpoints`` where the ``openai`` SDK's ``client.webhooks`` calls them.

Create (``url``, ``event_types``, ``name``; the answer holds the ``signing_secret``, shown only
then), list, retrieve, update, delete, and ``rotate_secret`` (optionally keeping the previous
secret signing for 24 hours). Each key sees only its own endpoints, which receive only its own
batches' events (``conveyor.worker.jobs.webhook_endpoints``; the operator's endpoints are
settings: ``CONVEYOR_WEBHOOK_URLS``).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from conveyor.worker.api.auth import Caller
from conveyor.worker.api.batch_create import read_json_body
from conveyor.worker.api.errors import ApiError, bad_request, not_found, validation_error
from conveyor.worker.api.services import ApiServices, Services
from conveyor.worker.core.storable_text import UnstorableText
from conveyor.worker.core.webhook_destination import DestinationRefused
from conveyor.worker.jobs.webhook_endpoints import (
    MAX_LIST_LIMIT,
    EndpointNotFound,
    TooManyEndpoints,
    create_endpoint,
    delete_endpoint,
    get_endpoint,
    list_endpoints,
    rotate_secret,
    update_endpoint,
)

MAX_BODY_BYTES = 16 * 1024

# Included twice (``create_app``): under ``PREFIXES``.
router = APIRouter(tags=["webhooks"])
PREFIXES = ("/v1/webhooks", "/v1/webhook_endpoints")


class EndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2048)
    event_types: list[str] = Field(min_length=1, max_length=16)
    name: str = Field("", max_length=128)


class EndpointUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(None, max_length=2048)
    event_types: list[str] | None = Field(None, min_length=1, max_length=16)
    name: str | None = Field(None, max_length=128)


class SecretRotation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_old_secret_active_for_24_hours: bool = False


M = TypeVar("M", bound=BaseModel)


async def _body(request: Request, services: ApiServices, model: type[M]) -> M:
    raw = await read_json_body(request, MAX_BODY_BYTES, services.settings.http_body_timeout_seconds)
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def _refusal(exc: ValueError, param: str) -> ApiError:
    if isinstance(exc, UnstorableText):
        return bad_request(str(exc), param=exc.field, code="invalid_value")
    if isinstance(exc, TooManyEndpoints):
        return bad_request(str(exc), code="too_many_webhook_endpoints")
    if isinstance(exc, DestinationRefused):
        return bad_request(f"Invalid webhook URL: {exc}", param="url", code="invalid_url")
    return bad_request(str(exc), param=param, code="invalid_value")


def _missing(exc: EndpointNotFound) -> ApiError:
    return not_found(str(exc))


def _create(services: ApiServices, owner: str | None, req: EndpointCreate) -> dict[str, Any]:
    if owner is None:
        raise bad_request(
            "This server takes no API keys (--insecure-no-auth): its webhooks are the operator's, "
            "CONVEYOR_WEBHOOK_URLS."
        )
    s = services.settings
    try:
        return create_endpoint(
            services.db, owner, url=req.url, event_types=req.event_types, name=req.name,
            allow_loopback=s.webhook_allow_loopback, max_per_key=s.webhook_max_endpoints_per_key,
        )  # fmt: skip
    except ValueError as exc:
        raise _refusal(exc, "event_types") from None


def _update(services: ApiServices, owner: str | None, endpoint_id: str, req: EndpointUpdate) -> dict[str, Any]:
    try:
        return update_endpoint(
            services.db, owner, endpoint_id, url=req.url, event_types=req.event_types, name=req.name,
            allow_loopback=services.settings.webhook_allow_loopback,
        )  # fmt: skip
    except EndpointNotFound as exc:
        raise _missing(exc) from None
    except ValueError as exc:
        raise _refusal(exc, "event_types") from None


@router.post("")
async def create_route(request: Request, owner: Caller, services: Services) -> dict[str, Any]:
    req = await _body(request, services, EndpointCreate)
    return await run_in_threadpool(_create, services, owner.id, req)


@router.get("")
def list_route(
    owner: Caller,
    services: Services,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    try:
        return list_endpoints(services.db, owner.id, limit=limit, after=after)
    except EndpointNotFound as exc:
        raise _missing(exc) from None


@router.get("/{endpoint_id}")
def retrieve_route(endpoint_id: str, owner: Caller, services: Services) -> dict[str, Any]:
    try:
        return get_endpoint(services.db, owner.id, endpoint_id)
    except EndpointNotFound as exc:
        raise _missing(exc) from None


@router.post("/{endpoint_id}")
async def update_route(endpoint_id: str, request: Request, owner: Caller, services: Services) -> dict[str, Any]:
    req = await _body(request, services, EndpointUpdate)
    return await run_in_threadpool(_update, services, owner.id, endpoint_id, req)


@router.delete("/{endpoint_id}")
def delete_route(endpoint_id: str, owner: Caller, services: Services) -> dict[str, Any]:
    try:
        return delete_endpoint(services.db, owner.id, endpoint_id)
    except EndpointNotFound as exc:
        raise _missing(exc) from None


@router.post("/{endpoint_id}/rotate_secret")
async def rotate_route(endpoint_id: str, request: Request, owner: Caller, services: Services) -> dict[str, Any]:
    req = await _body(request, services, SecretRotation)
    try:
        return await run_in_threadpool(
            rotate_secret, services.db, owner.id, endpoint_id, keep_old=req.keep_old_secret_active_for_24_hours
        )
    except EndpointNotFound as exc:
        raise _missing(exc) from None
