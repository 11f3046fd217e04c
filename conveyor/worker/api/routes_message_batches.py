"""``/v1/messages/batches``: Anthropic's Message Batches API over the same jobs as ``/v1/batches``.

Create (``conveyor.worker.api.message_batch_create``), retrieve, list (newest first, with
``before_id``/``after_id``/``limit`` and ``has_more``, ``first_id``, ``last_id``), cancel, delete
(an ended batch only) and results (JSONL, streamed). Objects are Anthropic's
(``conveyor.worker.jobs.message_batches``), errors too (``conveyor.worker.api.anthropic_errors``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from conveyor.worker.api.anthropic_auth import KeyHolder
from conveyor.worker.api.anthropic_errors import AnthropicRoute
from conveyor.worker.api.errors import ApiError
from conveyor.worker.api.message_batch_create import check_upload_slot, create_message_batch, read_batch_body
from conveyor.worker.api.services import ApiServices, Services
from conveyor.worker.api.uploads import drain
from conveyor.worker.jobs.lifecycle import finish_cancel
from conveyor.worker.jobs.message_batch_archive import archived_at
from conveyor.worker.jobs.message_batches import (
    MAX_LIST_LIMIT,
    NotEnded,
    cancel_message_batch,
    current_job,
    delete_message_batch,
    list_message_batches,
    message_batch_id,
    message_batch_object,
    processing_status,
    rfc3339,
)
from conveyor.worker.jobs.message_results import iter_results
from conveyor.worker.store.models import JobStatus

router = APIRouter(prefix="/v1/messages/batches", tags=["message batches"], route_class=AnthropicRoute)


def results_base(request: Request) -> str:
    """This route's URL as the client reached it, for ``results_url``."""
    return str(request.base_url).rstrip("/") + router.prefix


@router.post("")
async def create(request: Request, owner: KeyHolder, services: Services) -> dict[str, Any]:
    try:
        check_upload_slot(services)
    except ApiError:
        await drain(request.stream())
        raise
    async with services.uploads:
        text = await read_batch_body(request, services)
        job_id = await run_in_threadpool(create_message_batch, services, owner.id, text)
    return await run_in_threadpool(_object, services, message_batch_id(job_id), owner.id, results_base(request))


@router.get("")
def list_batches(
    request: Request,
    owner: KeyHolder,
    services: Services,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 20,
    before_id: Annotated[str | None, Query(max_length=64)] = None,
    after_id: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    if before_id is not None and after_id is not None:
        raise ApiError(400, "before_id and after_id cannot both be given.")
    jobs, more = list_message_batches(services.db, owner.id, limit=limit, before_id=before_id, after_id=after_id)
    base = results_base(request)
    keep = services.settings.message_batch_results_expire_after_seconds
    data = [message_batch_object(services.db, job, base, keep_results=keep) for job in jobs]
    return {
        "data": data,
        "has_more": more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.get("/{batch_id}")
def retrieve(batch_id: str, request: Request, owner: KeyHolder, services: Services) -> dict[str, Any]:
    return _object(services, batch_id, owner.id, results_base(request))


@router.post("/{batch_id}/cancel")
def cancel(
    batch_id: str, request: Request, owner: KeyHolder, services: Services, background: BackgroundTasks
) -> dict[str, Any]:
    """Answers ``canceling`` at once; the job's files are written after the answer is sent,
    as ``POST /v1/batches/{id}/cancel`` does."""
    job = cancel_message_batch(services.db, batch_id, owner.id)
    if JobStatus(job.status) is JobStatus.cancelling:
        hb = services.settings.heartbeat_seconds
        background.add_task(finish_cancel, services.db, services.store, job.id, heartbeat_seconds=hb)
    keep = services.settings.message_batch_results_expire_after_seconds
    return message_batch_object(services.db, job, results_base(request), keep_results=keep)


@router.delete("/{batch_id}")
def delete(batch_id: str, owner: KeyHolder, services: Services) -> dict[str, Any]:
    try:
        return delete_message_batch(services.db, services.store, batch_id, owner.id)
    except NotEnded as exc:
        raise ApiError(400, str(exc)) from None


@router.get("/{batch_id}/results")
def results(batch_id: str, owner: KeyHolder, services: Services) -> StreamingResponse:
    job = current_job(services.db, services.store, batch_id, owner.id, services.settings.heartbeat_seconds)
    if processing_status(job) != "ended":
        raise ApiError(
            400, f"Message batch {batch_id} is still {processing_status(job)}: results are available once it has ended."
        )
    keep = services.settings.message_batch_results_expire_after_seconds
    archived = archived_at(job.created_at, keep)
    if archived is not None:
        raise ApiError(
            404,
            f"The results of message batch {batch_id} were archived at {rfc3339(archived)}: they are kept "
            f"{keep} s after the batch is created, then deleted.",
        )
    return StreamingResponse(iterate_in_threadpool(iter_results(services.store, job)), media_type="application/x-jsonl")


def _object(services: ApiServices, batch_id: str, owner: str | None, base: str) -> dict[str, Any]:
    job = current_job(services.db, services.store, batch_id, owner, services.settings.heartbeat_seconds)
    return message_batch_object(
        services.db, job, base, keep_results=services.settings.message_batch_results_expire_after_seconds
    )
