"""A job's working objects: what it needs only while it runs, deleted once it has ended.

Under ``jobs/<id>/`` (``object_keys``): the copy of the input ``conveyor submit`` stores, the
shards' requests, the finished shards' results (``parts/``) and the lines refused at
validation. The results and errors files are built from the last two, so they go only after
those files are written (``finalize``), or when the job failed before it ran. A job whose shards
could not be enqueued keeps them for ``CONVEYOR_STORAGE_GRACE_SECONDS``: ``conveyor retry``
runs them. Whatever a crash leaves is the storage sweeper's (``storage_sweep``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from conveyor.worker.jobs import object_keys
from conveyor.worker.store.objects.base import ObjectStore

log = logging.getLogger(__name__)

WORKING_FOLDERS = ("shards/", "parts/")
WORKING_FILES = (object_keys.INVALID, *(object_keys.input_key(f) for f in ("jsonl", "csv", "parquet")))


def is_working_key(key: str) -> bool:
    """Whether ``key``, relative to a job's folder, is one of its working objects."""
    return key.startswith(WORKING_FOLDERS) or key in WORKING_FILES


def delete_working_objects(root_store: ObjectStore, job_id: str) -> int:
    """Delete job ``job_id``'s working objects (idempotent; nothing outside its folder);
    how many went. Call only once the job has ended and its output files are written."""
    job_store = root_store.scoped(object_keys.job_prefix(job_id))
    gone = sum(job_store.delete_folder(folder) for folder in WORKING_FOLDERS)
    for key in WORKING_FILES:
        job_store.delete(key)
    return gone


def discard_working_objects(root_store: ObjectStore, job_id: str, *, also: Sequence[str] = ()) -> None:
    """``delete_working_objects`` (and the job's keys ``also``) for a caller that has already
    ended the job: a store that fails now is logged, and the storage sweeper deletes them later."""
    try:
        job_store = root_store.scoped(object_keys.job_prefix(job_id))
        for key in also:
            job_store.delete(key)
        delete_working_objects(root_store, job_id)
    except Exception as exc:  # (the job's end is recorded; its leftovers are the sweeper's)
        log.warning("job %s: its working objects stay for the sweeper: %s: %s", job_id, type(exc).__name__, exc)
