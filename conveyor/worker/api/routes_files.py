"""``/v1/files``: upload (streamed, ``conveyor.worker.api.uploads``), list, retrieve, download, delete.

Every file belongs to the key that uploaded it (a batch's output files to the batch's key):
another key is told "not found" and never sees it listed. An upload past the owner's quotas
on files or stored bytes is answered 429 (``conveyor.worker.api.quota_checks``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from conveyor.worker.api.auth import Caller
from conveyor.worker.api.errors import ApiError
from conveyor.worker.api.quota_checks import check_upload_start, commit_within_quota, declared_length
from conveyor.worker.api.services import Services
from conveyor.worker.api.uploads import Pace, check_declared_length, drain, receive_upload
from conveyor.worker.jobs.files import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    FileInUse,
    delete_file,
    get_file,
    iter_chunks,
    list_files,
    open_content,
)

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post("")
async def create_file(request: Request, owner: Caller, services: Services) -> dict[str, Any]:
    settings = services.settings
    # Answered at once, body unread (the connection is closed after): a client announcing too
    # much may be waiting for this answer before it sends anything (``Expect: 100-continue``).
    check_declared_length(request, settings.max_upload_bytes)
    mine = services.uploads_by_owner.get(owner.id, 0)
    try:
        if mine >= settings.max_concurrent_uploads_per_key:
            raise ApiError(
                429,
                f"This key is uploading {mine} files at once already (CONVEYOR_MAX_CONCURRENT_UPLOADS_PER_KEY); "
                "retry when one has finished.",
                headers={"Retry-After": "1"},
            )
        if services.uploads.locked():
            raise ApiError(
                429,
                f"The server is taking {settings.max_concurrent_uploads} uploads at once already "
                "(CONVEYOR_MAX_CONCURRENT_UPLOADS); retry shortly.",
                headers={"Retry-After": "1"},
            )
    except ApiError:
        await drain(request.stream())
        raise
    # The key's slot is taken before the first await: another upload of the key, checked while
    # this one waits on the quota, counts it.
    services.uploads_by_owner[owner.id] = mine + 1
    try:
        try:
            await run_in_threadpool(check_upload_start, services, owner.id, declared_length(request))
        except ApiError:
            await drain(request.stream())
            raise
        pace = Pace(
            settings.upload_idle_timeout_seconds, settings.upload_min_bytes_per_second, settings.upload_max_seconds
        )
        async with services.uploads:
            upload, form = await receive_upload(
                request, services.store, max_bytes=settings.max_upload_bytes, max_line_bytes=settings.max_line_bytes,
                pace=pace,
            )  # fmt: skip
            return await run_in_threadpool(
                commit_within_quota,
                services,
                owner.id,
                upload,
                lambda check: upload.commit(
                    services.db,
                    owner=owner.id,
                    purpose=form.purpose,
                    filename=form.filename,
                    expires_after=form.expires_after,
                    check=check,
                ),
            )
    finally:
        left = services.uploads_by_owner.pop(owner.id, 1) - 1
        if left:
            services.uploads_by_owner[owner.id] = left


@router.get("")
def list_files_route(
    owner: Caller,
    services: Services,
    purpose: Annotated[str | None, Query(max_length=32)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = DEFAULT_LIST_LIMIT,
    after: Annotated[str | None, Query(max_length=64)] = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    return list_files(services.db, owner.id, purpose=purpose, limit=limit, after=after, order=order)


@router.get("/{file_id}")
def retrieve_file(file_id: str, owner: Caller, services: Services) -> dict[str, Any]:
    return get_file(services.db, file_id, owner.id)


@router.get("/{file_id}/content")
def file_content(file_id: str, owner: Caller, services: Services) -> StreamingResponse:
    obj, stream = open_content(services.db, services.store, file_id, owner.id)
    return StreamingResponse(
        iter_chunks(stream),
        media_type="application/octet-stream",
        headers={"Content-Length": str(obj["bytes"])},
    )


@router.delete("/{file_id}")
def delete_file_route(file_id: str, owner: Caller, services: Services) -> dict[str, Any]:
    try:
        return delete_file(services.db, services.store, file_id, owner.id)
    except FileInUse as exc:
        raise ApiError(409, f"{exc}; cancel the batch or wait until it is in progress.") from None
