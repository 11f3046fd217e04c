"""A whole job in this process (``conveyor run``): the same submit, shard and finalise code
as the queued path, with the shards run by a thread pool here instead of through a broker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from worker.client import Client, InputSource
from worker.context import WorkerContext
from worker.finalize import finalize_if_ready
from worker.runtime import EngineHost
from worker.settings import Settings
from worker.shards import RetryShard, ShardOutcome, run_shard
from worker.store.db import JobStatus

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0


def _run_with_retries(ctx: WorkerContext, job_id: str, index: int) -> ShardOutcome:
    while True:
        try:
            return run_shard(ctx, job_id, index)
        except RetryShard as exc:
            log.warning("shard %d failed (%s); retrying", index, exc)
            time.sleep(RETRY_SECONDS)


def run_job(
    settings: Settings,
    source: InputSource,
    model: str,
    *,
    shard_size: int | None = None,
    priority: int | None = None,
    concurrency: int | None = None,
    on_start: Callable[[dict[str, Any]], None] | None = None,
    on_items: Callable[[int], None] | None = None,
    host_factory: Callable[[], EngineHost] | None = None,
) -> dict[str, Any]:
    """Submit ``source`` without a broker, run every shard here, return the final job.
    ``on_start(job)`` runs once the input is validated (e.g. to size a progress bar).
    Ctrl-C cancels the job (results so far are kept) and re-raises."""
    if concurrency is not None and not 1 <= concurrency <= 256:
        raise ValueError(f"concurrency must be from 1 to 256, got {concurrency}")
    if isinstance(source, (str, os.PathLike)) and not Path(source).expanduser().is_file():
        raise FileNotFoundError(f"input file {str(source)!r} does not exist or is not a file")
    client = Client(settings)
    ctx: WorkerContext | None = None
    try:
        ctx = WorkerContext.create(settings, model, on_items=on_items, host_factory=host_factory)
        ctx.host()  # load the model first: a model that cannot load is an error, not a job
        job = client.submit(source, model, shard_size, priority, enqueue=False)
        if on_start is not None:
            on_start(job)
        if JobStatus(job["status"]).terminal:
            return job
        workers = max(1, min(concurrency or settings.worker_concurrency, job["num_shards"]))
        with ThreadPoolExecutor(workers, thread_name_prefix="conveyor-shard") as pool:
            futures = [pool.submit(_run_with_retries, ctx, job["id"], i) for i in range(job["num_shards"])]
            try:
                for future in futures:
                    future.result()
            except KeyboardInterrupt:
                client.cancel(job["id"])
                for future in futures:
                    future.cancel()
                raise
        finalize_if_ready(client.db, client.store, job["id"], heartbeat_seconds=settings.heartbeat_seconds)
        return client.status(job["id"])
    finally:
        if ctx is not None:
            ctx.close()
        client.close()
