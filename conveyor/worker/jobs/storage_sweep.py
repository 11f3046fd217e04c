"""Job objects that outlived their use, found by walking the store's ``jobs/`` folder.

- The working objects (``working_objects``) of a job that has ended: its finaliser died
  between recording the end and deleting them, or the store failed then. A job that failed to
  enqueue keeps its shards for ``CONVEYOR_STORAGE_GRACE_SECONDS`` after it failed, for
  ``conveyor retry``.
- A folder ``jobs/<id>/`` with no job row: an intake that crashed (or a row removed by hand).
  It goes whole once its newest object is older than the grace period, so a job being created
  right now is never touched.

Each pass reads one page of keys after where the last stopped and starts again from the top
at the end, so a store of any size costs one listing call and one query a pass. Several
workers sweeping at once delete the same objects: every deletion is idempotent. Folders whose
names are not job ids are never touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine

from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.working_objects import delete_working_objects, is_working_key
from conveyor.worker.store.models import Job, JobStatus, now
from conveyor.worker.store.objects.base import ObjectStore

log = logging.getLogger(__name__)

JOBS = "jobs/"
PAGE = 1000  # keys read a pass (one listing call on S3)


@dataclass
class StorageSweepReport:
    working: list[str] = field(default_factory=list)  # ended jobs whose working objects went
    orphans: list[str] = field(default_factory=list)  # folders of no job, deleted whole


class StorageSweeper:
    def __init__(self, db: Engine, store: ObjectStore, *, grace_seconds: float, page: int = PAGE) -> None:
        self.db, self.store, self.grace_seconds, self.page = db, store, grace_seconds, page
        self._after = ""  # the last key of the last pass; "" starts from the top

    def sweep_once(self) -> StorageSweepReport:
        infos = list(islice(self.store.list_info(JOBS, start_after=self._after), self.page))
        self._after = infos[-1].key if len(infos) == self.page else ""
        folders: dict[str, list[str]] = {}  # job id: its keys in this page, relative to its folder
        for info in infos:
            job_id, _, rest = info.key[len(JOBS) :].partition("/")
            if rest and object_keys.is_job_id(job_id):
                folders.setdefault(job_id, []).append(rest)
        report = StorageSweepReport()
        if not folders:
            return report
        with self.db.connect() as conn:
            rows = {
                row.id: row
                for row in conn.execute(
                    select(Job.id, Job.status, Job.failed_at, Job.errors).where(Job.id.in_(list(folders)))
                )
            }
        t = now()
        for job_id, keys in folders.items():
            row = rows.get(job_id)
            if row is None:
                if self._orphan_is_old(job_id, t):
                    self.store.delete_folder(f"{JOBS}{job_id}/")
                    report.orphans.append(job_id)
            elif self._ended(row, t) and any(is_working_key(key) for key in keys):
                delete_working_objects(self.store, job_id)
                report.working.append(job_id)
        if report.working or report.orphans:
            log.warning(
                "storage sweep: deleted the working objects of %d ended jobs and the folders of %d with no job",
                len(report.working), len(report.orphans),
            )  # fmt: skip
        return report

    def _orphan_is_old(self, job_id: str, t: float) -> bool:
        """Every object of the folder (not only those of this page) older than the grace period."""
        newest = max((info.modified for info in self.store.list_info(f"{JOBS}{job_id}/")), default=0.0)
        return t - newest > self.grace_seconds

    def _ended(self, row: Any, t: float) -> bool:
        status = JobStatus(row.status)
        if not status.terminal:
            return False
        codes = [e.get("code") for e in row.errors or []]
        if status is JobStatus.failed and codes == ["enqueue_failed"]:  # retryable: keep it a while
            return t - (row.failed_at or 0.0) > self.grace_seconds
        return True
