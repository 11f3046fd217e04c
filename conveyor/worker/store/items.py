"""Writing finished items: batched, idempotent on ``(job_id, custom_id)``.

A redelivered shard may finish an item a second time; the first stored copy wins and the
duplicate is dropped by the database (``INSERT ... ON CONFLICT DO NOTHING``), on SQLite and
on Postgres alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from conveyor.worker.store.models import Item, ItemStatus, Job, Shard, now


@dataclass
class ItemRecord:
    """One finished request, as the task layer hands it to ``record_finished_items``."""

    job_id: str
    custom_id: str
    shard_index: int
    line: int
    status: ItemStatus
    status_code: int = 200
    request_id: str | None = None
    response: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # a reasoning model's thinking, counted in completion_tokens
    preemptions: int = 0
    queue_time: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    worker_id: str | None = None
    finished_at: float = field(default_factory=now)


def _insert_ignoring_duplicates(conn: Connection):
    dialect = conn.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(Item).on_conflict_do_nothing(index_elements=["job_id", "custom_id"])
    if dialect == "sqlite":
        return sqlite.insert(Item).on_conflict_do_nothing(index_elements=["job_id", "custom_id"])
    raise NotImplementedError(f"record_finished_items supports sqlite and postgresql, not {dialect}")


def record_finished_items(engine: Engine, items: Sequence[ItemRecord]) -> list[str]:
    """Store ``items`` in one transaction; returns the custom_ids that were new.

    Items already stored (same ``job_id`` and ``custom_id``) are left untouched, so calling
    this twice with the same items stores each once. Duplicates inside ``items`` are fine.
    """
    if not items:
        return []
    rows = [dataclasses.asdict(item) for item in items]
    for row in rows:
        row["status"] = ItemStatus(row["status"])
    with engine.begin() as conn:
        stmt = _insert_ignoring_duplicates(conn).returning(Item.custom_id)
        return list(conn.execute(stmt, rows).scalars())


def stored_custom_ids(engine: Engine, job_id: str, shard_index: int | None = None) -> set[str]:
    """custom_ids of a job (or of one shard) already stored: a redelivered shard skips them."""
    stmt = select(Item.custom_id).where(Item.job_id == job_id)
    if shard_index is not None:
        stmt = stmt.where(Item.shard_index == shard_index)
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


def refresh_job_counts(engine: Engine, job_id: str) -> tuple[int, int, int]:
    """Recompute a job's request counts from its items; returns (total, completed, failed).

    ``failed`` = lines rejected at validation (``invalid_requests``) + failed items. Safe to
    call any time from any worker: it derives, never increments.
    """
    with engine.begin() as conn:
        return _set_job_counts(
            conn,
            job_id,
            completed=_count_items(Item.job_id == job_id, Item.status == ItemStatus.succeeded),
            failed=_count_items(Item.job_id == job_id, Item.status == ItemStatus.failed),
        )


def _count_items(*where: Any) -> Any:
    return select(func.count()).select_from(Item).where(*where).scalar_subquery()


def _sum_over_shards(job_id: str, column: Any) -> Any:
    return select(func.coalesce(func.sum(column), 0)).where(Shard.job_id == job_id).scalar_subquery()


def _set_job_counts(conn: Connection, job_id: str, *, completed: Any, failed: Any) -> tuple[int, int, int]:
    """Set the job's request counts (``failed`` adds the lines rejected at validation); returns
    (total, completed, failed) as stored."""
    conn.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(completed_requests=completed, failed_requests=Job.invalid_requests + failed, updated_at=now())
    )
    row = conn.execute(
        select(Job.total_requests, Job.completed_requests, Job.failed_requests).where(Job.id == job_id)
    ).one_or_none()
    if row is None:
        raise LookupError(f"no job {job_id!r}")
    return int(row[0]), int(row[1]), int(row[2])


def record_shard_counts(engine: Engine, job_id: str, shard_index: int) -> tuple[int, int, int]:
    """Count a released shard's stored items onto its row, then set the job's request counts
    to the sums over its shards; returns (total, completed, failed) as ``refresh_job_counts``.

    What a shard release costs this way does not grow with the job: it reads the shard's own
    items (``ix_items_job_shard``) and one row per shard, where a job-wide recount at every
    release made a job of N items cost N^2 / shard size. Derived, never incremented, so safe
    to redo; the finaliser still recounts the job (``refresh_job_counts``) once.
    """
    this_shard = (Item.job_id == job_id, Item.shard_index == shard_index)
    with engine.begin() as conn:
        conn.execute(
            update(Shard)
            .where(Shard.job_id == job_id, Shard.shard_index == shard_index)
            .values(
                succeeded_items=_count_items(*this_shard, Item.status == ItemStatus.succeeded),
                failed_items=_count_items(*this_shard, Item.status == ItemStatus.failed),
            )
        )
        return _set_job_counts(
            conn,
            job_id,
            completed=_sum_over_shards(job_id, Shard.succeeded_items),
            failed=_sum_over_shards(job_id, Shard.failed_items),
        )


_TIMINGS = {"queue_time": Item.queue_time, "ttft": Item.ttft, "tpot": Item.tpot, "e2e": Item.e2e}
_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def _percentiles(conn: Connection, job_id: str, column: Any) -> dict[str, float] | None:
    """mean/p50/p90/p99/max of one timing column, computed by the database (its sort, not
    this process's memory, carries a job of millions of items). A quantile is the value at
    rank ``round(q * (n - 1))`` of the sorted non-null values."""
    present = (Item.job_id == job_id) & column.is_not(None)
    n, mean, top = conn.execute(select(func.count(column), func.avg(column), func.max(column)).where(present)).one()
    if not n:
        return None
    out = {"mean": float(mean)}
    ranks = {name: min(n - 1, round(q * (n - 1))) for name, q in _QUANTILES.items()}
    # One sort for the three ranks (an OFFSET query per rank sorted a million items three times).
    ranked = (
        select(column.label("value"), (func.row_number().over(order_by=column) - 1).label("rank"))
        .where(present)
        .subquery()
    )
    at_rank = dict(
        conn.execute(select(ranked.c.rank, ranked.c.value).where(ranked.c.rank.in_(set(ranks.values())))).all()
    )
    for name, rank in ranks.items():
        out[name] = float(at_rank[rank])
    out["max"] = float(top)
    return out


def summarize_job(engine: Engine, job_id: str) -> dict[str, Any]:
    """Sum token usage over a job's items and compute latency percentiles; store both on
    the job (``prompt_tokens``, ``cached_tokens``, ``completion_tokens``, ``metrics``).

    ``metrics`` = ``{queue_time|ttft|tpot|e2e: {mean, p50, p90, p99, max} | None,
    preemptions, items}`` (seconds). Run at finalisation; idempotent.
    """
    sums = select(
        func.coalesce(func.sum(Item.prompt_tokens), 0),
        func.coalesce(func.sum(Item.cached_tokens), 0),
        func.coalesce(func.sum(Item.completion_tokens), 0),
        func.coalesce(func.sum(Item.reasoning_tokens), 0),
        func.coalesce(func.sum(Item.preemptions), 0),
        func.count(),
    ).where(Item.job_id == job_id)
    with engine.connect() as conn:
        prompt, cached, completion, reasoning, preemptions, count = conn.execute(sums).one()
        metrics: dict[str, Any] = {name: _percentiles(conn, job_id, col) for name, col in _TIMINGS.items()}
    metrics["preemptions"] = int(preemptions)
    metrics["items"] = int(count)
    with engine.begin() as conn:
        conn.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(
                prompt_tokens=int(prompt),
                cached_tokens=int(cached),
                completion_tokens=int(completion),
                reasoning_tokens=int(reasoning),
                metrics=metrics,
                updated_at=now(),
            )
        )
    return metrics
