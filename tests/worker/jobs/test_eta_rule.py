"""The time left is given only once enough lines finished over enough time, and its rate is
measured from the first finished line, never from the job's start."""

from __future__ import annotations

from conveyor.worker.jobs.progress import MIN_ETA_LINES, MIN_ETA_SECONDS, RateSample, eta_rule, progress, rate_sample
from conveyor.worker.store.item_totals import ItemTotals


def _totals(finished: int, recent: int, first: float | None) -> ItemTotals:
    return ItemTotals(finished, 0, 0, 0, 10 * finished, recent, 10 * recent, 0, first_finished_at=first)


def test_no_eta_before_enough_lines_or_seconds_and_it_says_so() -> None:
    few = eta_rule(100, RateSample(MIN_ETA_LINES - 1, MIN_ETA_LINES - 1, 0, 60.0, 60.0))
    assert few.seconds is None and few.note == f"after {MIN_ETA_LINES} lines finish ({MIN_ETA_LINES - 1} so far)"
    burst = eta_rule(100, RateSample(50, 50, 0, MIN_ETA_SECONDS - 1, MIN_ETA_SECONDS - 1))  # one wave, just now
    assert burst.seconds is None and burst.note is not None and "s of finished lines" in burst.note
    stalled = eta_rule(100, RateSample(50, 0, 0, 60.0, 600.0))
    assert stalled.seconds is None and stalled.note is not None
    ready = eta_rule(100, RateSample(MIN_ETA_LINES, 20, 0, 10.0, MIN_ETA_SECONDS))
    assert ready.seconds == 50.0 and ready.note is None  # 2 lines/s, 100 to go


def test_a_slow_start_does_not_stretch_the_eta() -> None:
    """The issue's job: 3 minutes before its first line finished (a model loading), then 2
    lines a second. Measured since the start, 300 lines looked like hours; from the first
    finished line, the rate is the job's pace."""
    started, first = 0.0, 180.0
    at = first + 30.0  # 61 lines finished: the first, then 2/s for 30 s
    since = max(at - 60.0, started)  # what the query counts "recent" from
    sample = rate_sample(_totals(61, 61, first), since, at)
    assert (sample.recent, sample.window, sample.observed) == (60, 30.0, 30.0)  # the first line starts the clock
    p = progress(300, 61, sample, output_tokens=610)
    assert p["requests_per_second"] == 2.0 and p["eta_seconds"] == 119.5 and p["eta_note"] is None
    # A minute later the window is the last minute only.
    at = first + 120.0
    sample = rate_sample(_totals(241, 120, first), at - 60.0, at)
    assert (sample.recent, sample.window) == (120, 60.0)
    assert progress(300, 241, sample, output_tokens=0)["eta_seconds"] == 29.5


def test_before_any_line_finishes_there_is_no_rate() -> None:
    p = progress(300, 0, rate_sample(_totals(0, 0, None), 0.0, 500.0), output_tokens=0)
    assert p["requests_per_second"] is None and p["eta_seconds"] is None
    assert p["eta_note"] == f"after {MIN_ETA_LINES} lines finish (0 so far)"
