"""Which waiting shard of a model runs next: fair between owners, across the fleet.

A shard message is a turn to run one of its model's pending shards, not necessarily the one
it names (every pending shard has a message of its own, so the turns add up). The turn goes
to the owner (the job's API key id; ``""`` for jobs without one) with the fewest shards of
the model running now on any worker, among those with shards pending and not at their limit
in this worker (``full``; a limit holds only while another owner has work for the model,
so a lone owner uses every place); between owners equally served, the one whose oldest waiting job
is oldest. Within that owner: fewer failed attempts first (a shard just retried waits its
turn behind the others), then the job's priority (lower first), its deadline (the
completion window orders one owner's jobs only), then a shard of a group this worker served
last (``prefer``: its prefix cache holds that prefix; ``conveyor.worker.jobs.shard_cut``), then the job's
age and the shard's index. A preference only orders the pending shards: the lease is taken as
for any other shard, and a turn with no preferred shard pending takes the next one at once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.engine import Engine

from conveyor.worker.store.models import Job, JobStatus, Shard, ShardStatus, now


@dataclass(frozen=True)
class ShardChoice:
    job_id: str
    shard_index: int
    owner: str
    group_key: str | None = None  # the prefix its lines share (grouped jobs)


@dataclass(frozen=True)
class Pick:
    """The shard to run (None: none may run here now) and how many owners have shards pending."""

    choice: ShardChoice | None
    waiting_owners: int


def next_shard(db: Engine, model: str, *, full: Collection[str] = (), prefer: Collection[str] = ()) -> Pick:
    """The pending shard of ``model`` whose turn it is, skipping the owners in ``full``;
    ``prefer``: group keys this worker served last."""
    waiting_cond = (
        Job.model == model,
        Job.status == JobStatus.in_progress,
        Shard.status == ShardStatus.pending,
    )
    with db.connect() as conn:
        waiting = {
            owner or "": oldest
            for owner, oldest in conn.execute(
                select(Job.owner, func.min(Job.created_at)).join(Shard, Shard.job_id == Job.id).where(*waiting_cond)
                .group_by(Job.owner)
            )
        }  # fmt: skip
        if not waiting:
            return Pick(None, 0)
        running: dict[str, int] = {}
        for owner, count in conn.execute(
            select(Job.owner, func.count()).join(Shard, Shard.job_id == Job.id)
            .where(Job.model == model, Shard.status == ShardStatus.running, Shard.lease_expires_at > now())
            .group_by(Job.owner)
        ):  # fmt: skip
            running[owner or ""] = running.get(owner or "", 0) + int(count)
        candidates = [owner for owner in waiting if owner not in full]
        if not candidates and len(waiting.keys() | running.keys()) == 1:
            # One owner has all the model's work: the place its limit keeps for another owner
            # would stay empty, so it takes the place (the next owner's shard gets the next turn).
            candidates = list(waiting)
        if not candidates:
            return Pick(None, len(waiting))
        owner = min(candidates, key=lambda o: (running.get(o, 0), waiting[o], o))
        affinity = [case((Shard.group_key.in_(list(prefer)), 0), else_=1)] if prefer else []
        row = conn.execute(
            select(Shard.job_id, Shard.shard_index, Shard.group_key).join(Job, Shard.job_id == Job.id)
            .where(*waiting_cond, Job.owner == owner if owner else Job.owner.is_(None))
            .order_by(
                Shard.failures, Job.priority, Job.expires_at.is_(None), Job.expires_at, *affinity, Job.created_at,
                Shard.shard_index,
            )
            .limit(1)
        ).one_or_none()  # fmt: skip
    if row is None:  # taken meanwhile
        return Pick(None, len(waiting))
    return Pick(ShardChoice(row.job_id, row.shard_index, owner, row.group_key), len(waiting))


def another_owner_waiting(db: Engine, model: str, owner: str) -> bool:
    """Whether an owner other than ``owner`` has a shard of ``model`` pending."""
    other = Job.owner.is_not(None) if not owner else (Job.owner.is_(None) | (Job.owner != owner))
    with db.connect() as conn:
        row = conn.execute(
            select(Shard.job_id).join(Job, Shard.job_id == Job.id)
            .where(Job.model == model, Job.status == JobStatus.in_progress, Shard.status == ShardStatus.pending, other)
            .limit(1)
        ).first()  # fmt: skip
    return row is not None


def job_owner(db: Engine, job_id: str) -> str:
    """The owner of ``job_id`` (``""`` for none, or no such job)."""
    with db.connect() as conn:
        owner = conn.execute(select(Job.owner).where(Job.id == job_id)).scalar_one_or_none()
    return owner or ""
