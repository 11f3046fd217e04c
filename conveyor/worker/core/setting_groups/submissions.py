"""The settings of how jobs arrive."""

from __future__ import annotations

from pydantic import BaseModel, Field

from conveyor.worker.core.limits import DEFAULT_COMPLETION_WINDOW, MIN_COMPLETION_WINDOW_SECONDS


class SubmissionSettings(BaseModel):
    """Submissions.

    How jobs arrive: their completion windows, and submissions through the broker.
    """

    # Completion windows.

    # A job's completion window when its submitter names none ("24h", "1h", "7d", ..., 1h to 30d).
    completion_window: str = DEFAULT_COMPLETION_WINDOW
    # Tests only: the shortest window a job may have, in seconds, so that expiry can be tested in seconds.
    min_completion_window_seconds: int = Field(MIN_COMPLETION_WINDOW_SECONDS, ge=1, le=MIN_COMPLETION_WINDOW_SECONDS)

    # ``conveyor serve`` also consumes the submission queue, so a broker submission is demand while no worker runs.
    api_takes_submissions: bool = True
    # A broker submission's ``reply_to`` (a queue or exchange name) must start with this, so a
    # producer cannot have announcements published into another application's queues; empty:
    # any name but Conveyor's own queues and ``amq.*``.
    reply_to_prefix: str = Field("", max_length=100)
