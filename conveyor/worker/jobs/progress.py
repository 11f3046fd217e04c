"""A running job's progress as its batch object shows it: requests done, the rate over the
last minute, the time left at that rate, and the tokens of the requests stored so far.

The rate counts items stored in the last ``RATE_WINDOW_SECONDS``, or since the job's first
item finished if that is later: never since the job started, since the minutes before its
first line finishes (a worker loading its model, a queue ahead) say nothing of its pace. It
follows the job as it speeds up or slows down without jumping with each burst of finished
requests.

The time left (``eta_seconds``) is the requests still to run at that rate, given only once
``MIN_ETA_LINES`` lines have finished and ``MIN_ETA_SECONDS`` have passed since the first
did; until then ``eta_note`` says what it waits for (``eta_rule``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Engine

from conveyor.worker.store.item_totals import ItemTotals, item_totals
from conveyor.worker.store.models import Job, JobStatus, now

RATE_WINDOW_SECONDS = 60.0
MIN_WINDOW_SECONDS = 1.0  # a rate over less says nothing
MIN_ETA_LINES = 20
MIN_ETA_SECONDS = 5.0


@dataclass(frozen=True)
class RateSample:
    """What the rate and the time left are read from."""

    finished: int  # lines finished so far (items stored)
    recent: int  # of them, those finished within the window
    recent_tokens: int  # their output tokens
    window: float  # seconds the window spans (0 before the first line finishes)
    observed: float  # seconds since the first line finished (0 before)


@dataclass(frozen=True)
class Eta:
    seconds: float | None
    note: str | None  # while ``seconds`` is None: what it waits for


def eta_rule(remaining: int, sample: RateSample) -> Eta:
    """The time left, once enough lines have finished over enough time to mean something."""
    if sample.finished < MIN_ETA_LINES:
        return Eta(None, f"after {MIN_ETA_LINES} lines finish ({sample.finished} so far)")
    if sample.observed < MIN_ETA_SECONDS:
        return Eta(None, f"after {MIN_ETA_SECONDS:.0f} s of finished lines")
    if sample.window < MIN_WINDOW_SECONDS or sample.recent <= 0:
        return Eta(None, "unknown: no line finished in the last minute")
    return Eta(remaining * sample.window / sample.recent, None)


def rate_sample(totals: ItemTotals, since: float, at: float) -> RateSample:
    """``totals`` read with ``recent`` counted from ``since``: the window starts there, or at
    the first finished line if later. Then that line only starts the clock (its work was done
    before), so it is not counted in the rate."""
    finished = totals.succeeded + totals.failed
    first = totals.first_finished_at
    if first is None:
        return RateSample(finished, 0, 0, 0.0, 0.0)
    if first >= since:
        recent, window = max(0, totals.recent - 1), at - first
    else:
        recent, window = totals.recent, at - since
    return RateSample(finished, recent, totals.recent_completion_tokens, max(0.0, window), max(0.0, at - first))


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
    obj["progress"] = progress(
        job.total_requests, totals.succeeded + failed, rate_sample(totals, since, at), totals.completion_tokens
    )
    return obj


def progress(total: int, done: int, sample: RateSample, output_tokens: int) -> dict[str, Any]:
    """The ``progress`` field: ``done`` of ``total``, ``requests_per_second`` and
    ``output_tokens_per_second`` over the last ``window_seconds`` (None before a second has
    passed since the first line finished), ``eta_seconds`` by ``eta_rule`` (else ``eta_note``)."""
    remaining = max(0, total - done)
    rate = tok_rate = None
    if sample.window >= MIN_WINDOW_SECONDS:
        rate = sample.recent / sample.window
        tok_rate = sample.recent_tokens / sample.window
    eta = eta_rule(remaining, sample)
    return {
        "done": done,
        "total": total,
        "remaining": remaining,
        "window_seconds": round(sample.window, 1),
        "requests_per_second": None if rate is None else round(rate, 3),
        "output_tokens_per_second": None if tok_rate is None else round(tok_rate, 1),
        "eta_seconds": None if eta.seconds is None else round(eta.seconds, 1),
        "eta_note": eta.note,
        "output_tokens": output_tokens,
    }
