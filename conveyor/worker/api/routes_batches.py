"""``/v1/batches``: create (``conveyor.worker.api.batch_create``), list, retrieve, cancel, and
``GET /v1/batches/{id}/unfinished`` (beyond OpenAI's API): a cancelled or expired batch's input
lines that never ran, as uploaded, to upload again as a new batch's input.

A batch is a job: its object is the job's batch object less the fields OpenAI does not
document (``priority``, the storage URIs, ``metrics``, shard counts: those stay in
``conveyor status --json``), so it validates as ``openai.types.Batch`` with nothing extra.
Every batch belongs to the key that created it; another key is told "not found".
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from conveyor.worker.api.auth import Caller
from conveyor.worker.api.batch_create import create_batch, parse_body, read_json_body
from conveyor.worker.api.errors import ApiError
from conveyor.worker.api.services import Services
from conveyor.worker.jobs.lifecycle import finish_cancel
from conveyor.worker.jobs.output_files import iter_lines
from conveyor.worker.jobs.owned_jobs import (
    MAX_LIST_LIMIT,
    NotCancellable,
    cancel_owned_batch,
    list_owned_batches,
    owned_batch,
)
from conveyor.worker.jobs.unfinished_reads import NotEnded, NoUnfinished, open_unfinished

router = APIRouter(prefix="/v1/batches", tags=["batches"])

BATCH_FIELDS = (
    "id", "object", "endpoint", "model", "errors", "input_file_id", "completion_window", "status",
    "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
    "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts", "usage",
    "metadata",
)  # fmt: skip


def api_batch(obj: dict[str, Any]) -> dict[str, Any]:
    """A job's batch object with OpenAI's fields only."""
    return {name: obj[name] for name in BATCH_FIELDS}


@router.post("")
async def create_batch_route(request: Request, owner: Caller, services: Services) -> dict[str, Any]:
    req = parse_body(await read_json_body(request, seconds=services.settings.http_body_timeout_seconds))
    idempotency = request.headers.get("idempotency-key")
    return api_batch(await run_in_threadpool(create_batch, services, owner.id, req, idempotency))


@router.get("")
def list_batches(
    owner: Caller,
    services: Services,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    page = list_owned_batches(services.db, owner.id, limit=limit, after=after)
    page["data"] = [api_batch(b) for b in page["data"]]
    return page


@router.get("/{batch_id}")
def retrieve_batch(batch_id: str, owner: Caller, services: Services) -> dict[str, Any]:
    hb = services.settings.heartbeat_seconds
    return api_batch(owned_batch(services.db, services.store, batch_id, owner.id, heartbeat_seconds=hb))


@router.post("/{batch_id}/cancel")
def cancel_batch(batch_id: str, owner: Caller, services: Services, background: BackgroundTasks) -> dict[str, Any]:
    """Answers ``cancelling`` at once, as OpenAI does; the job's files are written after the
    answer is sent (they can be large), or by a worker's sweeper if this process stops first."""
    try:
        batch = cancel_owned_batch(services.db, batch_id, owner.id)
    except NotCancellable as exc:
        raise ApiError(409, str(exc)) from None
    if batch["status"] == "cancelling":
        hb = services.settings.heartbeat_seconds
        background.add_task(finish_cancel, services.db, services.store, batch_id, heartbeat_seconds=hb)
    return api_batch(batch)


@router.get("/{batch_id}/unfinished")
def unfinished_lines(batch_id: str, owner: Caller, services: Services) -> StreamingResponse:
    """The batch's input lines that never ran (``batch_cancelled`` or ``batch_expired`` in its
    errors file), as uploaded: empty for a completed batch, 409 while it runs."""
    hb = services.settings.heartbeat_seconds
    owned_batch(services.db, services.store, batch_id, owner.id, heartbeat_seconds=hb)  # not found: 404
    try:
        stream = open_unfinished(services.db, services.store, batch_id)
    except NotEnded as exc:
        raise ApiError(409, str(exc)) from None
    except NoUnfinished as exc:
        raise ApiError(404, str(exc)) from None
    return StreamingResponse(iter_lines(stream), media_type="application/jsonl")
