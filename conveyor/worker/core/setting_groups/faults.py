"""The settings of fault handling."""

from __future__ import annotations

from pydantic import BaseModel, Field


class FaultSettings(BaseModel):
    """Faults.

    Fault handling (see the fault model in the docs).
    """

    # How often a running shard looks for a cancel of its job.
    cancel_poll_seconds: float = Field(1.0, gt=0)
    # How often each worker sweeps for shards of dead workers, lost messages and expired jobs.
    sweep_interval_seconds: float = Field(15.0, gt=0)
    # Attempts a failing shard gets; only attempts that raised in the worker count (not outages, not deaths).
    shard_max_attempts: int = Field(3, ge=1, le=100)
    # A task holds its message through this much database or storage outage, then hands it back to the broker.
    dependency_retry_seconds: float = Field(900.0, gt=0)
    # A down dependency is checked again with a backoff of at most this long.
    dependency_backoff_max_seconds: float = Field(30.0, gt=0)
    # Deaths of a worker while an item ran alone before that poison item becomes a ``worker_crashed`` error.
    item_max_crashes: int = Field(3, ge=1, le=100)
    # An engine step that has not returned after this long is a hang: the worker exits, handled like a crash.
    step_timeout_seconds: float = Field(600.0, gt=0)
    # The most shards one job may be split into.
    max_shards_per_job: int = Field(100_000, ge=1)
    # A job created by reference still ``validating`` this long after creation gets its intake message again.
    intake_resend_seconds: float = Field(300.0, gt=0)
    # A job folder with no job (an intake that crashed), or the shards of a job that failed to
    # enqueue (``conveyor retry`` runs them), are kept this long, then the storage sweep deletes them.
    storage_grace_seconds: float = Field(86_400.0, gt=0)
    # A worker counts as live while its last heartbeat is at most this old; ``submit`` and ``status`` say when none is.
    worker_live_seconds: float = Field(60.0, gt=0)
    # Workers silent this long leave the registry (each model's newest stays); checked hourly by every worker.
    worker_retention_seconds: float = Field(7 * 86_400.0, gt=0)
