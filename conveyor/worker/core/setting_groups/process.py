"""The settings of the worker and server processes."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ProcessSettings(BaseModel):
    """Processes.

    How worker and server processes stop, and what they log. Stopping (serverless): Kubernetes'
    default grace period is 30 s, and the default drains within it.
    """

    # On SIGTERM, running shards finish for up to this long, then what is left is handed back and the worker exits 0.
    drain_timeout_seconds: float = Field(25.0, gt=0, le=86_400)
    # With no task for this long, the worker drains and exits 0 (a KEDA ScaledJob); unset: it waits forever.
    exit_when_idle_seconds: float | None = Field(None, gt=0)

    # The log level of worker and server processes (DEBUG, INFO, WARNING...).
    log_level: str = "INFO"
