"""A running job's progress as its batch object shows it: requests done, the rate over the
last minute, the time left at that rate, and the tokens of the requests stored so far.

The rate counts items stored in the last ``RATE_WINDOW_SECONDS`` (or since the job started,
if later), so it follows the job as it speeds up or slows down without jumping with each
burst of finished requests; the time left is the requests still to run at that rate.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from conveyor.worker.store.item_totals import ItemTotals, item_totals
from conveyor.worker.store.models import Job, JobStatus, now

RATE_WINDOW_SECONDS = 60.0
MIN_WINDOW_SECONDS = 1.0  # a rate over less says nothing


def is_live(job: Job) -> bool:
    """Items are being stored (not while finalising: then the counts are final)."""
    status = JobStatus(job.status)
    return status is JobStatus.in_progress or (status is JobStatus.cancelling and job.finalizing_at is None)


def live_batch_object(db: Engine, job: Job, at: float | None = None) -> dict[str, Any]:
    """``job.as_batch_object()`` with the counts, usage and ``progress`` of its items so far
    (read only); a job that is not live is shown as stored."""
    obj = job.as_batch_object()
    if not is_live(job):
        return obj
    at = now() if at is None else at
    started = job.in_progress_at or job.created_at
    since = max(at - RATE_WINDOW_SECONDS, started)
    totals = item_totals(db, job.id, since)
    failed = job.invalid_requests + totals.failed
    obj["request_counts"] = {"total": job.total_requests, "completed": totals.succeeded, "failed": failed}
    obj["usage"] = {
        "input_tokens": totals.prompt_tokens,
        "input_tokens_details": {"cached_tokens": totals.cached_tokens},
        "output_tokens": totals.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": totals.reasoning_tokens},
        "total_tokens": totals.prompt_tokens + totals.completion_tokens,
    }
    obj["progress"] = progress(job.total_requests, totals.succeeded + failed, totals, at - since)
    return obj


def progress(total: int, done: int, totals: ItemTotals, window: float) -> dict[str, Any]:
    """The ``progress`` field: ``done`` of ``total``, ``requests_per_second`` and
    ``output_tokens_per_second`` over the last ``window_seconds`` (None before a second has
    passed), ``eta_seconds`` at that rate (None while nothing finished in the window)."""
    remaining = max(0, total - done)
    rate = tok_rate = eta = None
    if window >= MIN_WINDOW_SECONDS:
        rate = totals.recent / window
        tok_rate = totals.recent_completion_tokens / window
        eta = remaining / rate if rate > 0 else None
    return {
        "done": done,
        "total": total,
        "remaining": remaining,
        "window_seconds": round(window, 1),
        "requests_per_second": None if rate is None else round(rate, 3),
        "output_tokens_per_second": None if tok_rate is None else round(tok_rate, 1),
        "eta_seconds": None if eta is None else round(eta, 1),
        "output_tokens": totals.completion_tokens,
    }
