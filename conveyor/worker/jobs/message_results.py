"""An ended Message Batch's results as JSONL, streamed from its job's files a line at a time.

The results file's lines become ``succeeded`` results and the errors file's ``errored`` (or
``expired``) ones (``conveyor.worker.batchio.anthropic_results``). The requests with neither
(a cancel stopped them, or the job failed as a whole) are then named from the batch's list of
custom_ids: ``canceled``, or ``errored`` with the job's error. Only the custom_ids seen are held.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO

from conveyor.worker.batchio.anthropic_results import (
    API_ERROR,
    errored_response,
    individual_response,
    unrun_response,
)
from conveyor.worker.batchio.output_lines import dumps_line
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.message_batch_input import CUSTOM_IDS
from conveyor.worker.store.models import Job, JobStatus
from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, ObjectStore


def iter_results(store: ObjectStore, job: Job) -> Iterator[bytes]:
    """The results lines of an ended job (``message_batches.ENDED``)."""
    seen: set[str] = set()
    for uri in (job.output_uri, job.error_uri):
        stream = _open(store, uri)
        if stream is None:
            continue
        with stream:
            for raw in stream:
                if raw.strip():
                    result = individual_response(json.loads(raw))
                    seen.add(result["custom_id"])
                    yield dumps_line(result)
    status = JobStatus(job.status)
    if status is JobStatus.completed:
        return  # every request has its line
    reason = "; ".join(str(e.get("message")) for e in job.errors or []) or "the batch failed"
    stream = _open(store, store.scoped(object_keys.job_prefix(job.id)).uri(CUSTOM_IDS))
    if stream is None:
        return
    with stream:
        for raw in stream:
            custom_id = raw.decode("ascii").strip()
            if not custom_id or custom_id in seen:
                continue
            if status is JobStatus.failed:
                yield dumps_line(errored_response(custom_id, API_ERROR, reason))
            else:
                yield dumps_line(unrun_response(custom_id, "expired" if status is JobStatus.expired else "canceled"))


def _open(store: ObjectStore, uri: str | None) -> BinaryIO | None:
    if uri is None:
        return None
    try:
        return store.open_read(store.key_of(uri))
    except (InvalidKey, ObjectNotFound):
        return None
