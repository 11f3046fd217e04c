"""A stopped job's unfinished input: the lines of its requests that never ran (cancelled or
expired), as submitted, ready to submit again (``conveyor results --unfinished``,
``GET /v1/batches/{id}/unfinished``).

Written by the finaliser of a cancelled or expired job, while its input is still stored (a
copy that ``conveyor submit`` made goes with the job's working objects), next to its results
and errors files. Lines that ran, failed on their own or were refused at validation are not
in it: resubmitting them would give the same answer.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.engine import Engine

from conveyor.worker.batchio.input_subset import write_subset
from conveyor.worker.batchio.output_lines import UNRUN_CODES
from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.jobs import object_keys
from conveyor.worker.store.models import Item, ItemStatus, Job
from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)


def unrun_lines(db: Engine, job_id: str) -> set[int]:
    """The input line numbers of the job's requests stored as never run."""
    stmt = select(Item.line, Item.error).where(Item.job_id == job_id, Item.status == ItemStatus.failed)
    with db.connect() as conn:
        rows = conn.execution_options(yield_per=1000).execute(stmt)
        return {line for line, error in rows if (error or {}).get("code") in UNRUN_CODES}


def write_unfinished(db: Engine, root_store: ObjectStore, job_id: str) -> int | None:
    """Write the job's unfinished input (``object_keys.unfinished_key``); how many records it
    holds, or None when the input is gone."""
    with db.connect() as conn:
        job = conn.execute(select(Job.input_uri, Job.input_format).where(Job.id == job_id)).one()
    fmt = InputFormat(job.input_format or InputFormat.jsonl.value)
    try:
        stream = root_store.open_read(root_store.key_of(job.input_uri or ""))
    except (InvalidKey, ObjectNotFound) as exc:
        log.warning("job %s: its input is gone, so its unfinished lines cannot be written: %s", job_id, exc)
        return None
    lines = unrun_lines(db, job_id)
    job_store = root_store.scoped(object_keys.job_prefix(job_id))
    with stream, job_store.open_write(object_keys.unfinished_key(fmt.value)) as out:
        return write_subset(stream, fmt, lines, out.write)
