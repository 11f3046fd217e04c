"""``POST /v1/messages/batches``: a Message Batch from inline requests, recorded as a job.

The body (at most ``CONVEYOR_MESSAGE_BATCH_MAX_BYTES``: 413 past it; one upload slot while it
is handled) is read whole, then its requests are decoded and written one at a time as the
job's input under the job's own prefix (``conveyor.worker.jobs.message_batch_input``). A batch
Anthropic would refuse is a 400 naming the request
(``conveyor.worker.batchio.anthropic_batch_body``); so is one whose requests name more than one
model (a job runs one) or a model nobody serves. The owner's quotas are checked as for any
batch (``conveyor.worker.api.quota_checks``). Then the job is recorded ``validating`` and a
worker is asked to take it in, as ``POST /v1/batches`` does: a request whose ``params`` cannot
be served becomes that request's ``errored`` result.
"""

from __future__ import annotations

from starlette.requests import Request

from conveyor.worker.api.batch_create import read_json_body
from conveyor.worker.api.errors import ApiError, bad_request
from conveyor.worker.api.quota_checks import create_within_quota
from conveyor.worker.api.services import ApiServices
from conveyor.worker.batchio.anthropic_batch_body import BatchBodyError, iter_batch_requests
from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.batchio.batch_scan import BatchScan
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.broker.queues import enqueue_intake
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.catalog import catalog
from conveyor.worker.jobs.message_batch_input import INPUT, store_requests
from conveyor.worker.jobs.owned_jobs import fail_unqueued
from conveyor.worker.jobs.quotas import Charge
from conveyor.worker.jobs.submission import SubmitOptions, create_job
from conveyor.worker.store.objects.base import ObjectStore

COMPLETION_WINDOW = "24h"  # Anthropic's: a batch expires 24 hours after it was created


async def read_batch_body(request: Request, services: ApiServices) -> str:
    """The body as text, refused past its size and its time."""
    settings = services.settings
    raw = await read_json_body(request, settings.message_batch_max_bytes, settings.upload_max_seconds)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"The request body is not UTF-8 (byte {exc.start}).") from None


def check_upload_slot(services: ApiServices) -> None:
    """429 while every upload slot is taken: a batch body is as large as a file upload, and is
    held until its requests are stored, so it takes one of their slots."""
    if services.uploads.locked():
        raise ApiError(
            429, f"The server is taking {services.settings.max_concurrent_uploads} uploads at once already "
            "(CONVEYOR_MAX_CONCURRENT_UPLOADS); retry shortly.", headers={"Retry-After": "1"},
        )  # fmt: skip


def create_message_batch(services: ApiServices, owner: str | None, text: str) -> str:
    """Record the batch of ``text``'s requests and hand it to the workers; its job id."""
    settings, db, store = services.settings, services.db, services.store
    job_id = object_keys.new_job_id()
    job_store = store.scoped(object_keys.job_prefix(job_id))
    try:
        scan = store_requests(job_store, iter_batch_requests(text, settings.message_batch_max_requests))
    except BatchBodyError as exc:
        raise bad_request(exc.message, param=exc.param) from None
    charge = Charge.of_scan(scan, settings.default_max_tokens)  # stored on the job: it holds until the job ends
    try:
        options = SubmitOptions(
            model=_served_model(services, scan), completion_window=COMPLETION_WINDOW,
            request_options=RequestOptions(endpoint=MESSAGES),
        )  # fmt: skip
        create_within_quota(
            services, owner, charge,
            lambda check: create_job(
                db, store, settings, job_store.uri(INPUT), options, owner=owner, job_id=job_id, charge=charge,
                check=check,
            ),
        )  # fmt: skip
    except BaseException as exc:
        _discard(job_store)  # nothing is kept of a batch that was not created
        if isinstance(exc, ValueError):  # an option create_job refused
            raise bad_request(str(exc)) from None
        raise
    try:
        enqueue_intake(services.broker, job_id, settings.queue_prefix)
    except Exception as exc:
        fail_unqueued(db, job_id, f"the batch could not be handed to the workers: {type(exc).__name__}")
        raise ApiError(503, "The server cannot reach its broker right now; try again shortly.") from None
    return job_id


def _served_model(services: ApiServices, scan: BatchScan) -> str:
    """The one model the requests name, if this deployment serves it; else the 400."""
    if len(scan.models) > 1 or scan.more_models:
        shown = ", ".join(repr(m[:80]) for m in scan.models[:4]) + (", ..." if scan.more_models else "")
        raise bad_request(
            f"requests: the batch's requests name several models ({shown}); Conveyor runs a batch on one model: "
            "send each model's requests as a batch of its own."
        )
    if not scan.models:
        raise bad_request("requests: no request names a model (params.model).")
    model = scan.models[0]
    known = catalog(services.db, services.settings)
    if model not in {m.model for m in known}:
        listed = ", ".join([repr(m.model) for m in known if m.live_workers][:20]) or "none"
        raise bad_request(f"model: {model!r} is not served here (served now: {listed}).")
    return model


def _discard(job_store: ObjectStore) -> None:
    for key in list(job_store.list()):
        job_store.delete(key)
