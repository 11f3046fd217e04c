"""Shard leases: compare-and-set in one conditional UPDATE, so at most one holder.

A task acquires its shard before running it, heartbeats while it runs, and releases it
with the shard's final status. The lease is taken only if nobody holds it or the holder's
lease has expired (a dead worker); every later write names the owner, so a worker whose
lease was taken over learns it (``False`` / ``LeaseLost``) instead of overwriting.

Owners must be unique per task execution (``new_lease_owner()``), not per process: a
broker may redeliver a shard to the very process that is still running it.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from sqlalchemy import and_, or_, update
from sqlalchemy.engine import Connection, Engine

from conveyor.worker.store.crashes import record_death
from conveyor.worker.store.models import Shard, ShardStatus, now


class LeaseLost(RuntimeError):
    """This worker no longer holds the shard's lease (it expired and another took over)."""


def new_lease_owner() -> str:
    """``host:pid:random``: unique per task execution."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _this_shard(job_id: str, shard_index: int):
    return and_(Shard.job_id == job_id, Shard.shard_index == shard_index)


def _held_by(job_id: str, shard_index: int, owner: str):
    """This shard, running under ``owner``'s lease."""
    return and_(_this_shard(job_id, shard_index), Shard.status == ShardStatus.running, Shard.lease_owner == owner)


def acquire_lease(
    engine: Engine, job_id: str, shard_index: int, owner: str, ttl: float, *, at: float | None = None
) -> bool:
    """Take the shard's lease for ``ttl`` seconds; True if this call won it.

    Succeeds for a shard that is ``pending``, or ``running`` under an expired lease (its
    holder died: ``record_death`` counts it in the same transaction), or ``running`` under
    ``owner`` itself (a task taking its lease again after waiting out an outage). Winning
    from someone else sets status ``running``, counts an attempt and stamps ``started_at``.
    """
    t = now() if at is None else at
    this = _this_shard(job_id, shard_index)
    fresh = {"status": ShardStatus.running, "lease_owner": owner, "lease_expires_at": t + ttl, "heartbeat_at": t}
    taken = {**fresh, "attempts": Shard.attempts + 1, "started_at": t}
    dead_holder = and_(
        Shard.status == ShardStatus.running, or_(Shard.lease_owner.is_(None), Shard.lease_expires_at < t)
    )
    with engine.begin() as conn:
        if _update(conn, _held_by(job_id, shard_index, owner), fresh):
            return True
        if _update(conn, and_(this, dead_holder), taken):
            record_death(conn, job_id, shard_index)
            return True
        return _update(conn, and_(this, Shard.status == ShardStatus.pending), taken)


def _update(conn: Connection, where: Any, values: dict[str, Any]) -> bool:
    stmt = update(Shard).where(where).values(**values).execution_options(synchronize_session=False)
    return conn.execute(stmt).rowcount == 1


def heartbeat_lease(
    engine: Engine, job_id: str, shard_index: int, owner: str, ttl: float, *, at: float | None = None
) -> bool:
    """Extend our lease to ``now + ttl``; False if we no longer hold it (stop working)."""
    t = now() if at is None else at
    stmt = (
        update(Shard)
        .where(
            _held_by(job_id, shard_index, owner),
        )
        .values(lease_expires_at=t + ttl, heartbeat_at=t)
        .execution_options(synchronize_session=False)
    )
    with engine.begin() as conn:
        return conn.execute(stmt).rowcount == 1


def release_lease(
    engine: Engine,
    job_id: str,
    shard_index: int,
    owner: str,
    status: ShardStatus,
    *,
    output_uri: str | None = None,
    error: str | None = None,
    failed_attempt: bool = False,
    at: float | None = None,
) -> bool:
    """Give the lease up and set the shard's status; False if we did not hold it.

    ``status`` is ``completed``/``failed``/``cancelled`` when done, or ``pending`` to hand
    the shard back for another attempt (e.g. on worker shutdown). ``failed_attempt``
    counts this attempt in ``failures`` (it raised in the worker).
    """
    t = now() if at is None else at
    values: dict[str, object] = {"status": status, "lease_owner": None, "lease_expires_at": None, "solo_item": None}
    if failed_attempt:
        values["failures"] = Shard.failures + 1
    if status is not ShardStatus.pending:
        values["finished_at"] = t
    if output_uri is not None:
        values["output_uri"] = output_uri
    if error is not None:
        values["error"] = error
    stmt = (
        update(Shard)
        .where(
            _held_by(job_id, shard_index, owner),
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    with engine.begin() as conn:
        return conn.execute(stmt).rowcount == 1
