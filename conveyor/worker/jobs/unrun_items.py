"""The requests a stopped job never ran, recorded as failed items: ``batch_expired`` when its
completion window passed, ``batch_cancelled`` when it was cancelled.

Recording them as items (rather than writing lines straight into the errors file) keeps one
source of truth: the request counts, ``results --follow`` and the errors file all read items,
so each accounts for every request, and results plus errors always equal the input. Items are
idempotent on ``(job, custom_id)``: a finaliser that runs twice, or a late result of a
straggling shard, never doubles a request.

A job stopped before its intake ran has no shards: its requests are read from its input, each
line (valid or not: it never got as far as being checked) one unrun item.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Engine, Row

from conveyor.worker.batchio.output_lines import (
    BATCH_CANCELLED,
    BATCH_CANCELLED_MESSAGE,
    BATCH_EXPIRED,
    BATCH_EXPIRED_MESSAGE,
)
from conveyor.worker.batchio.readers import iter_input
from conveyor.worker.batchio.records import InputError, InputFormat, ParsedRequest
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import DEFAULT_LIMITS
from conveyor.worker.jobs import object_keys
from conveyor.worker.store.items import ItemRecord, record_finished_items, stored_custom_ids
from conveyor.worker.store.models import ItemStatus, Job, Shard, ShardStatus
from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)

_WRITE_BATCH = 1000
# An input stopped before intake already passed its door's size checks: read it whole.
_WHOLE_INPUT = dataclasses.replace(DEFAULT_LIMITS, max_input_bytes=1 << 62, max_lines=1 << 62)


@dataclass(frozen=True)
class UnrunReason:
    """Why a request never ran: its error code and message, as OpenAI words them."""

    code: str
    message: str


EXPIRED = UnrunReason(BATCH_EXPIRED, BATCH_EXPIRED_MESSAGE)
CANCELLED = UnrunReason(BATCH_CANCELLED, BATCH_CANCELLED_MESSAGE)


def record_unrun_items(db: Engine, root_store: ObjectStore, job_id: str, reason: UnrunReason) -> int:
    """Store a failed item, with ``reason``, for each request of ``job_id`` not finished yet;
    returns how many were new."""
    with db.connect() as conn:
        job = conn.execute(
            select(Job.in_progress_at, Job.input_uri, Job.input_format, Job.request_options).where(Job.id == job_id)
        ).one()
        shards = list(
            conn.execute(
                select(Shard.shard_index)
                .where(Shard.job_id == job_id, Shard.status != ShardStatus.completed)
                .order_by(Shard.shard_index)
            ).scalars()
        )
    if job.in_progress_at is None and job.input_uri is not None:
        return _record_before_intake(db, root_store, job_id, job, reason)
    job_store = root_store.scoped(object_keys.job_prefix(job_id))
    new = 0
    for index in shards:
        done = stored_custom_ids(db, job_id, index)
        with job_store.open_read(object_keys.shard_input_key(index)) as stream:
            requests = (ParsedRequest.from_json(json.loads(line)) for line in stream if line.strip())
            unrun = ((req.custom_id, req.line) for req in requests if req.custom_id not in done)
            new += _record(db, job_id, index, unrun, reason)
    return new


def _record_before_intake(db: Engine, root_store: ObjectStore, job_id: str, job: Row[Any], reason: UnrunReason) -> int:
    """Every line of a job's input as an unrun item (the job never counted them: its total
    becomes their number)."""
    try:
        stream = root_store.open_read(root_store.key_of(job.input_uri))
    except (InvalidKey, ObjectNotFound) as exc:
        log.warning("job %s stopped before intake and its input is gone: %s", job_id, exc)
        return 0
    fmt = InputFormat(job.input_format or InputFormat.jsonl.value)
    options = RequestOptions.from_json(job.request_options)
    lines: list[int] = []

    def named() -> Iterator[tuple[str, int]]:
        try:
            for record in iter_input(stream, _WHOLE_INPUT, fmt, options):
                lines.append(record.line)
                yield (record.custom_id or f"line-{record.line}"), record.line
        except InputError as exc:  # the whole input would have been refused: its lines so far stand
            log.warning("job %s: input unreadable after %d lines: %s", job_id, len(lines), exc)

    with stream:
        new = _record(db, job_id, 0, named(), reason)
    with db.begin() as conn:
        conn.execute(update(Job).where(Job.id == job_id).values(total_requests=len(lines)))
    return new


def _record(db: Engine, job_id: str, shard_index: int, unrun: Iterator[tuple[str, int]], reason: UnrunReason) -> int:
    error = {"code": reason.code, "message": reason.message, "param": None}
    new = 0
    records: list[ItemRecord] = []
    for custom_id, line in unrun:
        records.append(
            ItemRecord(
                job_id=job_id,
                custom_id=custom_id,
                shard_index=shard_index,
                line=line,
                status=ItemStatus.failed,
                status_code=0,  # it never ran: no HTTP status
                error=error,
            )
        )
        if len(records) >= _WRITE_BATCH:
            new += len(record_finished_items(db, records))
            records = []
    return new + len(record_finished_items(db, records))
