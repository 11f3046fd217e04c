"""What a running job's stored items add up to so far: counts, tokens, and how many finished
recently (for a rate). Read only, one query over the job's items."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.engine import Engine

from conveyor.worker.store.models import Item, ItemStatus


@dataclass(frozen=True)
class ItemTotals:
    succeeded: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    recent: int  # items finished at or after ``since``
    recent_completion_tokens: int
    reasoning_tokens: int
    first_finished_at: float | None = None  # when the job's first item finished


def item_totals(engine: Engine, job_id: str, since: float) -> ItemTotals:
    """The job's stored items so far, and those finished at or after ``since``."""
    recent = Item.finished_at >= since

    def count(cond: Any) -> Any:
        return func.coalesce(func.sum(case((cond, 1), else_=0)), 0)

    stmt = select(
        count(Item.status == ItemStatus.succeeded),
        count(Item.status == ItemStatus.failed),
        func.coalesce(func.sum(Item.prompt_tokens), 0),
        func.coalesce(func.sum(Item.cached_tokens), 0),
        func.coalesce(func.sum(Item.completion_tokens), 0),
        count(recent),
        func.coalesce(func.sum(case((recent, Item.completion_tokens), else_=0)), 0),
        func.coalesce(func.sum(Item.reasoning_tokens), 0),
        func.min(Item.finished_at),
    ).where(Item.job_id == job_id)
    with engine.connect() as conn:
        row = conn.execute(stmt).one()
    first = row[-1]
    counts = ItemTotals(*(int(v) for v in row[:-1]))
    return dataclasses.replace(counts, first_finished_at=None if first is None else float(first))
