"""Recovering work a dead worker left behind (every worker sweeps its own model's jobs).

- A ``running`` shard whose lease expired (its worker died or hung) is handed back
  (``pending``), its holder's death counted (``store/crashes.py``), and enqueued again;
  the lease guarantees only one worker runs it. After this sweeper could not reach the
  database, it waits a lease period before judging leases: their holders, alive but cut
  off by the same outage, renew them first.
- A ``pending`` shard whose message was lost (a broker that drops a dead consumer's
  unacknowledged messages, such as kombu's SQLAlchemy transport) is enqueued again once
  the model's queue is empty and the shard has waited a whole lease period since it was
  last enqueued (``heartbeat_at`` of a pending shard is when it was last enqueued). Right
  after the worker reconnected to its broker (``after_broker_reconnect``), which may have
  lost every message (a Redis restarted without persistence), the next sweep runs at once
  and does not wait that lease period. A duplicate message is harmless: its task finds the
  lease taken or the shard done and exits.
- A job whose finaliser died (``finalizing``, no heartbeat for a lease period), or whose
  last shard's worker died before finalising, gets a finalisation task.
- A job created by reference to a stored input (``create_job``: the HTTP API, a broker
  submission) that is still ``validating`` ``intake_resend_seconds`` after it was created (or
  last re-sent) gets its intake message again: the broker may have lost it, and intake is
  idempotent. Every sweeper looks at every model's (the intake queue is shared). A job that
  ``conveyor submit`` ingests in its own process has no intake message: it is left alone.

Every hand-over is a compare-and-set, so of several sweeping workers exactly one acts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import and_, exists, or_, select, update
from sqlalchemy.engine import Engine

from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.finalize import ACTIVE_SHARD
from conveyor.worker.store.crashes import record_death
from conveyor.worker.store.models import Job, JobStatus, Shard, ShardStatus, now

log = logging.getLogger(__name__)

BATCH = 64
LIVE = (JobStatus.in_progress, JobStatus.cancelling)


@dataclass
class SweepReport:
    expired: list[tuple[str, int]] = field(default_factory=list)
    lost: list[tuple[str, int]] = field(default_factory=list)
    finalize: list[str] = field(default_factory=list)  # claim and finalise
    refinalize: list[str] = field(default_factory=list)  # redo a stalled finalisation
    intakes: list[str] = field(default_factory=list)  # validating too long: send the intake again


class Sweeper:
    def __init__(
        self,
        db: Engine,
        model: str,
        settings: Settings,
        enqueue_shard: Callable[[str, int], None],
        enqueue_finalize: Callable[[str, bool], None],
        queue_depth: Callable[[], int | None],
        enqueue_intake: Callable[[str], None] | None = None,
    ) -> None:
        self.db, self.model, self.settings = db, model, settings
        self._enqueue_shard = enqueue_shard
        self._enqueue_finalize = enqueue_finalize
        self._queue_depth = queue_depth
        self._enqueue_intake = enqueue_intake
        self._judge_leases_from = 0.0  # monotonic time; later after an outage of the database
        self._failed = False
        self._reconnected = False

    def after_broker_reconnect(self) -> None:
        """The broker connection came back (maybe having lost its messages): the next lost
        message pass takes every pending shard, however recently it was enqueued."""
        self._reconnected = True

    def sweep_once(self) -> SweepReport:
        if self._failed:  # the last sweep failed: let live holders renew their leases first
            self._judge_leases_from = time.monotonic() + self.settings.lease_seconds
        try:
            report = self._sweep()
        except Exception:
            self._failed = True
            raise
        self._failed = False
        return report

    def _sweep(self) -> SweepReport:
        report = SweepReport()
        if time.monotonic() >= self._judge_leases_from:
            self._expired_leases(report)
        reconnected, self._reconnected = self._reconnected, False
        depth = self._queue_depth()
        if depth == 0:
            self._lost_messages(report, min_age=0.0 if reconnected else self.settings.lease_seconds)
        elif depth is None and reconnected:
            self._reconnected = True  # the broker cannot tell its depth yet: next time
        self._stalled_jobs(report)
        if self._enqueue_intake is not None:
            self._stalled_intakes(report)
            for job_id in report.intakes:
                self._enqueue_intake(job_id)
        for job_id, index in report.expired + report.lost:
            self._enqueue_shard(job_id, index)
        for job_id in report.finalize:
            self._enqueue_finalize(job_id, False)
        for job_id in report.refinalize:
            self._enqueue_finalize(job_id, True)
        if report.expired or report.lost or report.finalize or report.refinalize or report.intakes:
            log.warning(
                "sweep: re-enqueued %d shards with expired leases, %d with lost messages; %d jobs to finalise; "
                "%d intakes sent again",
                len(report.expired), len(report.lost), len(report.finalize) + len(report.refinalize),
                len(report.intakes),
            )  # fmt: skip
        return report

    def _my_live_jobs(self):
        return select(Job.id).where(Job.model == self.model, Job.status.in_(LIVE))

    def _expired_leases(self, report: SweepReport) -> None:
        t = now()
        with self.db.begin() as conn:
            rows = conn.execute(
                select(Shard.job_id, Shard.shard_index)
                .where(
                    Shard.job_id.in_(self._my_live_jobs()),
                    Shard.status == ShardStatus.running,
                    Shard.lease_expires_at < t,
                )
                .limit(BATCH)
            ).all()
            for job_id, index in rows:
                won = conn.execute(
                    update(Shard)
                    .where(
                        Shard.job_id == job_id,
                        Shard.shard_index == index,
                        Shard.status == ShardStatus.running,
                        Shard.lease_expires_at < t,
                    )
                    .values(status=ShardStatus.pending, lease_owner=None, lease_expires_at=None, heartbeat_at=t)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if won:
                    record_death(conn, job_id, index)
                    report.expired.append((job_id, index))

    def _lost_messages(self, report: SweepReport, min_age: float) -> None:
        t = now()
        before = t - min_age
        with self.db.begin() as conn:
            rows = conn.execute(
                select(Shard.job_id, Shard.shard_index, Shard.heartbeat_at)
                .where(
                    Shard.job_id.in_(self._my_live_jobs()),
                    Shard.status == ShardStatus.pending,
                    or_(Shard.heartbeat_at.is_(None), Shard.heartbeat_at < before),
                )
                .order_by(Shard.job_id, Shard.shard_index)
                .limit(BATCH)
            ).all()
            for job_id, index, seen in rows:
                same = Shard.heartbeat_at.is_(None) if seen is None else Shard.heartbeat_at == seen
                won = conn.execute(
                    update(Shard)
                    .where(
                        Shard.job_id == job_id, Shard.shard_index == index, Shard.status == ShardStatus.pending, same
                    )
                    .values(heartbeat_at=t)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if won:
                    report.lost.append((job_id, index))

    def _stalled_jobs(self, report: SweepReport) -> None:
        t = now()
        before = t - max(self.settings.lease_seconds, 3 * self.settings.heartbeat_seconds)
        no_active = ~exists().where(Shard.job_id == Job.id, Shard.status.in_(ACTIVE_SHARD))
        claimed = and_(Job.finalizing_at.is_not(None), Job.status.in_((JobStatus.finalizing, JobStatus.cancelling)))
        unclaimed = and_(Job.finalizing_at.is_(None), Job.status.in_(LIVE), no_active)
        with self.db.begin() as conn:
            rows = conn.execute(
                select(Job.id, Job.updated_at, Job.finalizing_at)
                .where(Job.model == self.model, Job.updated_at < before, or_(claimed, unclaimed))
                .limit(BATCH)
            ).all()
            for job_id, updated_at, finalizing_at in rows:
                won = conn.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.updated_at == updated_at)
                    .values(updated_at=t)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if won:
                    (report.refinalize if finalizing_at is not None else report.finalize).append(job_id)

    def _stalled_intakes(self, report: SweepReport) -> None:
        t = now()
        before = t - self.settings.intake_resend_seconds
        with self.db.begin() as conn:
            rows = conn.execute(
                select(Job.id, Job.updated_at, Job.input_uri, Job.input_format)
                .where(Job.status == JobStatus.validating, Job.updated_at < before)
                .order_by(Job.updated_at)
                .limit(BATCH)
            ).all()
            for job_id, updated_at, input_uri, input_format in rows:
                own_copy = f"/{object_keys.job_prefix(job_id)}/{object_keys.input_key(input_format or 'jsonl')}"
                if (input_uri or "").endswith(own_copy):  # ingested by its submitter: no message to lose
                    continue
                won = conn.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.status == JobStatus.validating, Job.updated_at == updated_at)
                    .values(updated_at=t)
                    .execution_options(synchronize_session=False)
                ).rowcount
                if won:
                    report.intakes.append(job_id)
