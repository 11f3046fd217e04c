"""The requests an expired job never finished, recorded as ``batch_expired`` failed items.

Recording them as items (rather than writing lines straight into the errors file) keeps one
source of truth: the request counts, ``results --follow`` and the errors file all read items,
so each accounts for every request. Items are idempotent on ``(job, custom_id)``: a finaliser
that runs twice, or a late result of a straggling shard, never doubles a request.
"""

from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.engine import Engine

from conveyor.worker.batchio.output_lines import BATCH_EXPIRED, BATCH_EXPIRED_MESSAGE
from conveyor.worker.batchio.records import ParsedRequest
from conveyor.worker.jobs import object_keys
from conveyor.worker.store.items import ItemRecord, record_finished_items, stored_custom_ids
from conveyor.worker.store.models import ItemStatus, Shard, ShardStatus
from conveyor.worker.store.objects.base import ObjectStore

_WRITE_BATCH = 1000


def record_expired_items(db: Engine, job_store: ObjectStore, job_id: str) -> int:
    """Store a ``batch_expired`` failed item for each request of ``job_id`` not finished yet
    (only shards that did not complete can have one); returns how many were new."""
    with db.connect() as conn:
        shards = list(
            conn.execute(
                select(Shard.shard_index)
                .where(Shard.job_id == job_id, Shard.status != ShardStatus.completed)
                .order_by(Shard.shard_index)
            ).scalars()
        )
    new = 0
    for index in shards:
        done = stored_custom_ids(db, job_id, index)
        records: list[ItemRecord] = []
        with job_store.open_read(object_keys.shard_input_key(index)) as stream:
            for line in stream:
                if not line.strip():
                    continue
                req = ParsedRequest.from_json(json.loads(line))
                if req.custom_id in done:
                    continue
                records.append(
                    ItemRecord(
                        job_id=job_id,
                        custom_id=req.custom_id,
                        shard_index=index,
                        line=req.line,
                        status=ItemStatus.failed,
                        status_code=0,  # it never ran: no HTTP status
                        error={"code": BATCH_EXPIRED, "message": BATCH_EXPIRED_MESSAGE, "param": None},
                    )
                )
                if len(records) >= _WRITE_BATCH:
                    new += len(record_finished_items(db, records))
                    records = []
        new += len(record_finished_items(db, records))
    return new
