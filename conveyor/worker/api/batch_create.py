"""``POST /v1/batches``: a batch from an uploaded file, created without reading the file.

What the upload learnt (``conveyor.worker.batchio.batch_scan``, kept in the file's ``metadata``)
decides at once whether the batch can run, each refusal a 400 naming its parameter:

- ``endpoint`` is ``/v1/chat/completions`` or ``/v1/completions``;
- ``completion_window`` is one Conveyor takes (``24h`` as OpenAI; any whole hours or days
  from ``1h`` to ``30d`` too);
- ``output_expires_after`` is OpenAI's: ``{"anchor": "created_at", "seconds": 3600 to
  2592000}``; the batch's output and error files expire that long after each is written
  (``CONVEYOR_BATCH_OUTPUT_EXPIRES_AFTER_SECONDS`` when it is absent);
- the file (``input_file_id``: 404 if the caller has none of that id) has purpose ``batch``,
  holds at least one request, no more than OpenAI's 50,000 (``CONVEYOR_BATCH_MAX_REQUESTS``)
  and ``CONVEYOR_MAX_LINES_PER_JOB``, is no larger than OpenAI's 200 MB
  (``CONVEYOR_BATCH_MAX_FILE_BYTES``) and ``CONVEYOR_MAX_INPUT_BYTES``, and an embeddings
  batch's lines hold no more than 50,000 inputs in all (``CONVEYOR_BATCH_MAX_EMBEDDING_INPUTS``);
- its lines name one model in ``body.model`` (as OpenAI requires) and every ``url`` is the
  batch's ``endpoint``;
- the model is one this deployment runs (``GET /v1/models``, ``conveyor.worker.jobs.catalog``): declared
  in ``CONVEYOR_MODELS`` or served by some worker before, whether or not one runs now (an
  autoscaler starts one on the demand the batch adds); a batch for a model nobody ever runs
  would only wait until it expired;
- the owner's quotas allow one more batch of the file's lines and output tokens (a 429
  naming the limit otherwise: ``conveyor.worker.api.quota_checks``).

The job is then recorded ``validating`` (``create_job``) and a worker is asked to read the
file (``enqueue_intake``): lines it rejects one by one (bad JSON, a bad body, a missing
field, a plain row or a line to another endpoint than the batch's) become lines of the
batch's errors file, and the rest run. An ``Idempotency-Key``
header makes a retried request find the batch it created.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.engine import Engine
from starlette.requests import ClientDisconnect, Request

from conveyor.worker.api.errors import ApiError, bad_request, not_found, validation_error
from conveyor.worker.api.quota_checks import create_within_quota
from conveyor.worker.api.services import ApiServices
from conveyor.worker.batchio.batch_scan import BatchScan
from conveyor.worker.batchio.embeddings_body import EMBEDDINGS
from conveyor.worker.batchio.request_body import ENDPOINTS
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.broker.queues import enqueue_intake
from conveyor.worker.core.limits import completion_window_seconds
from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.catalog import catalog
from conveyor.worker.jobs.files import BATCH, FileNotFound, StoredFileInfo, get_file_info
from conveyor.worker.jobs.owned_jobs import fail_unqueued
from conveyor.worker.jobs.quotas import Charge
from conveyor.worker.jobs.submission import (
    MetadataError,
    SubmitOptions,
    check_metadata,
    create_job,
    http_idempotency_key,
    job_request_options,
    job_with_key,
)

MAX_JSON_BODY_BYTES = 64 << 10  # 16 metadata pairs of 64 + 512 characters fit many times over
MAX_IDEMPOTENCY_KEY_CHARS = 128


class BatchCreate(BaseModel):
    """OpenAI's create-batch body (an unknown field is a 400, as OpenAI answers it)."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(min_length=1, max_length=128)
    completion_window: str = Field(min_length=1, max_length=16)
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


# OpenAI's bounds on ``output_expires_after.seconds``: an hour to 30 days.
MIN_OUTPUT_EXPIRY_SECONDS, MAX_OUTPUT_EXPIRY_SECONDS = 3600, 30 * 86_400


def output_expiry_seconds(value: dict[str, Any] | None, default: int) -> int | None:
    """The lifetime of a batch's output files from ``output_expires_after`` (``default`` when
    absent; None: kept until deleted), or OpenAI's 400 naming the field at fault."""
    if value is None:
        return default or None
    unknown = sorted(set(value) - {"anchor", "seconds"})
    if unknown:
        param = f"output_expires_after.{unknown[0][:64]}"
        raise bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    for name in ("anchor", "seconds"):
        if name not in value:
            param = f"output_expires_after.{name}"
            raise bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    anchor, seconds = value["anchor"], value["seconds"]
    if anchor != "created_at":
        raise bad_request(
            f"Invalid value: {str(anchor)[:64]!r}. Supported values are: 'created_at'.",
            param="output_expires_after.anchor",
            code="invalid_value",
        )
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise bad_request(
            f"Invalid type for 'output_expires_after.seconds': expected an integer, but got "
            f"{type(seconds).__name__} instead.",
            param="output_expires_after.seconds",
            code="invalid_type",
        )
    if seconds < MIN_OUTPUT_EXPIRY_SECONDS:
        raise bad_request(
            f"Invalid 'output_expires_after.seconds': integer below minimum value. Expected a value >= "
            f"{MIN_OUTPUT_EXPIRY_SECONDS}, but got {seconds} instead.",
            param="output_expires_after.seconds",
            code="integer_below_min_value",
        )
    if seconds > MAX_OUTPUT_EXPIRY_SECONDS:
        raise bad_request(
            f"Invalid 'output_expires_after.seconds': integer above maximum value. Expected a value <= "
            f"{MAX_OUTPUT_EXPIRY_SECONDS}, but got {seconds} instead.",
            param="output_expires_after.seconds",
            code="integer_above_max_value",
        )
    return seconds


async def read_json_body(request: Request, limit: int = MAX_JSON_BODY_BYTES, seconds: float = 30.0) -> bytes:
    """The request's body, refused with 413 past ``limit`` bytes (never held whole), and with
    408 when it has not all come within ``seconds`` (CONVEYOR_HTTP_BODY_TIMEOUT_SECONDS)."""
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"The request body is larger than {limit} bytes.", headers={"Connection": "close"})

    try:
        await asyncio.wait_for(read(), seconds)
    except ClientDisconnect:
        raise bad_request("The client went away before the request body was read.") from None
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            f"The request body did not arrive within {seconds:g} s (CONVEYOR_HTTP_BODY_TIMEOUT_SECONDS).",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return bytes(body)


def parse_body(raw: bytes) -> BatchCreate:
    try:
        return BatchCreate.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def batch_model(scan: BatchScan | None, endpoint: str, file_id: str, nbytes: int, settings: Settings) -> str:
    """The model a batch file names, if it can run as a batch to ``endpoint``; else the 400."""
    param = "input_file_id"
    if scan is None or not scan.lines:
        raise bad_request(f"The input file {file_id} holds no requests.", param=param, code="empty_file")
    if scan.lines > settings.batch_max_requests:
        raise bad_request(
            f"The input file {file_id} holds {scan.lines} requests; a batch's input file holds at most "
            f"{settings.batch_max_requests} requests (CONVEYOR_BATCH_MAX_REQUESTS).",
            param=param,
            code="too_many_requests",
        )
    if nbytes > settings.batch_max_file_bytes:
        raise bad_request(
            f"The input file {file_id} is {nbytes} bytes; a batch's input file is at most "
            f"{settings.batch_max_file_bytes} bytes (CONVEYOR_BATCH_MAX_FILE_BYTES).",
            param=param,
            code="file_too_large",
        )
    if endpoint == EMBEDDINGS and scan.embedding_inputs > settings.batch_max_embedding_inputs:
        raise bad_request(
            f"The input file {file_id} holds {scan.embedding_inputs} embedding inputs across its requests; an "
            f"embeddings batch holds at most {settings.batch_max_embedding_inputs} "
            "(CONVEYOR_BATCH_MAX_EMBEDDING_INPUTS).",
            param=param,
            code="too_many_embedding_inputs",
        )
    if scan.lines > settings.max_lines_per_job:
        raise bad_request(
            f"The input file {file_id} holds {scan.lines} requests; a batch takes at most "
            f"{settings.max_lines_per_job} (CONVEYOR_MAX_LINES_PER_JOB).",
            param=param,
            code="too_many_requests",
        )
    if nbytes > settings.max_input_bytes:
        raise bad_request(
            f"The input file {file_id} is {nbytes} bytes; a batch's input is at most {settings.max_input_bytes} "
            "bytes (CONVEYOR_MAX_INPUT_BYTES).",
            param=param,
            code="file_too_large",
        )
    stray = [url for url in scan.urls if url != endpoint]
    if stray or scan.more_urls:
        shown = ", ".join(repr(u[:80]) for u in stray[:3])
        raise bad_request(
            f"Lines of the input file ask for url {shown}, not the batch's endpoint {endpoint!r}: a batch's lines "
            "all go to its endpoint.",
            param=param,
            code="mismatched_endpoint",
        )
    if len(scan.models) > 1 or scan.more_models:
        shown = ", ".join(repr(m[:80]) for m in scan.models[:4]) + (", ..." if scan.more_models else "")
        raise bad_request(
            f"The input file mixes models ({shown}): a batch runs one model, as OpenAI requires; "
            "put each model's lines in a file of its own.",
            param=param,
            code="mixed_models",
        )
    if not scan.models:
        raise bad_request(
            f"No line of the input file {file_id} names a model (body.model).", param=param, code="missing_model"
        )
    return scan.models[0]


def create_batch(services: ApiServices, owner: str | None, req: BatchCreate, idempotency: str | None) -> dict[str, Any]:
    """Check the request and the file, record the job and have a worker ingest it; the batch
    object (with all of the job's fields: the route keeps OpenAI's)."""
    settings, db = services.settings, services.db
    metadata = _checked_fields(req, settings)
    keep_outputs = output_expiry_seconds(req.output_expires_after, settings.batch_output_expires_after_seconds)
    key = None
    if idempotency is not None:
        if not 1 <= len(idempotency) <= MAX_IDEMPOTENCY_KEY_CHARS:
            raise bad_request(f"The Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters.")
        key = http_idempotency_key(owner, idempotency)
        existing = job_with_key(db, key)
        if existing is not None:  # a retry: the batch it made, whatever happened since (not a new check)
            return _same_request(db, existing, req, metadata, keep_outputs)
    info = _input_file(db, req, owner)
    model = _served_model(db, info, req, settings)
    # Intake takes only lines to the endpoint (a plain row or another url is that line's error).
    options = SubmitOptions(
        model=model,
        completion_window=req.completion_window,
        request_options=RequestOptions(endpoint=req.endpoint, output_expires_after=keep_outputs),
    )
    scan = info.batch_scan
    assert scan is not None  # batch_model refused a file without one
    charge = Charge.of_scan(scan, settings.default_max_tokens)  # stored on the job: it holds until the job ends
    try:
        batch, created = create_within_quota(
            services, owner, charge,
            lambda check: create_job(
                db, services.store, settings, info.uri, options, metadata=metadata, owner=owner,
                input_file_id=req.input_file_id, idempotency_key=key, charge=charge, check=check,
            ),
        )  # fmt: skip
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    if not created:  # the same key, created at the same moment by another request
        return _same_request(db, batch, req, metadata, keep_outputs)
    try:
        enqueue_intake(services.broker, batch["id"], settings.queue_prefix)
    except Exception as exc:
        fail_unqueued(db, batch["id"], f"the batch could not be handed to the workers: {type(exc).__name__}")
        raise ApiError(503, "The server cannot reach its broker right now; try again shortly.") from None
    return batch


def _checked_fields(req: BatchCreate, settings: Settings) -> dict[str, str] | None:
    """The request's endpoint, completion window and metadata checked; the metadata to keep."""
    if req.endpoint not in ENDPOINTS:
        raise bad_request(
            f"Invalid value for 'endpoint': {req.endpoint!r}; Conveyor serves {', '.join(ENDPOINTS)}.",
            param="endpoint",
            code="invalid_value",
        )
    try:
        completion_window_seconds(req.completion_window, settings.min_completion_window_seconds)
    except ValueError as exc:
        raise bad_request(f"Invalid value for 'completion_window': {exc}", param="completion_window") from None
    try:
        metadata = check_metadata(req.metadata)
    except MetadataError as exc:
        raise bad_request(str(exc), param="metadata", code=exc.code) from None
    except ValueError as exc:  # text PostgreSQL cannot store
        raise bad_request(f"Invalid value for 'metadata': {exc}", param="metadata") from None
    return metadata


def _input_file(db: Engine, req: BatchCreate, owner: str | None) -> StoredFileInfo:
    """The batch's input file: the owner's, not expired, with purpose ``batch``."""
    try:
        info = get_file_info(db, req.input_file_id, owner)
    except FileNotFound as exc:  # (an expired one says so)
        raise not_found(str(exc), param="input_file_id") from None
    if info.object["purpose"] != BATCH:
        raise bad_request(
            f"File {req.input_file_id} has purpose {info.object['purpose']!r}; a batch's input file has purpose "
            "'batch'.",
            param="input_file_id",
        )
    return info


def _served_model(db: Engine, info: StoredFileInfo, req: BatchCreate, settings: Settings) -> str:
    """The model the input file's lines name, refused unless the deployment serves it."""
    model = batch_model(info.batch_scan, req.endpoint, req.input_file_id, info.object["bytes"], settings)
    known = catalog(db, settings)
    if model not in {m.model for m in known}:
        listed = ", ".join([repr(m.model) for m in known if m.live_workers][:20]) or "none"
        raise bad_request(
            f"The model {model!r} is not served by any live worker (served now: {listed}); start one with "
            f"`conveyor worker --model CHECKPOINT --served-model-name {model}`.",
            param="model",
            code="model_not_found",
        )
    return model


def _same_request(
    db: Engine, batch: dict[str, Any], req: BatchCreate, metadata: dict[str, str] | None, keep_outputs: int | None
) -> dict[str, Any]:
    """``batch`` if it was created by this same request, else 409: a key names one request (as
    Stripe's and OpenAI's idempotency keys do), so a reused key with other fields is a mistake."""
    asked = {
        "input_file_id": req.input_file_id, "endpoint": req.endpoint,
        "completion_window": req.completion_window, "metadata": metadata or None,
    }  # fmt: skip
    differs = [name for name, value in asked.items() if (batch.get(name) or None) != value]
    if job_request_options(db, batch["id"]).output_expires_after != keep_outputs:
        differs.append("output_expires_after")
    if differs:
        raise ApiError(
            409,
            f"This Idempotency-Key was already used for batch {batch['id']} with a different "
            f"{', '.join(differs)}; use a new key for a new batch.",
            param=differs[0],
            code="idempotency_key_reused",
        )
    return batch
