"""A whole job in this process (``conveyor run``): the same submit, shard and finalise code
as the queued path, with the shards run by a thread pool here instead of through a broker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from conveyor.worker.batchio.input_check import check_input_start
from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.settings import Settings
from conveyor.worker.entrypoints.client import Client, InputSource
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.dependency_gate import DependencyUnavailable
from conveyor.worker.execution.engine_host import EngineHost
from conveyor.worker.execution.shard_runner import ANOTHER_HOLDS_IT, RetryShard, ShardOutcome, run_shard
from conveyor.worker.jobs.finalize import finalize_if_ready
from conveyor.worker.jobs.webhook_dispatch import WebhookDispatcher
from conveyor.worker.store.items import ItemRecord
from conveyor.worker.store.models import JobStatus

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C once the job existed: it was cancelled (what finished is kept); ``job_id`` names it."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


def _run_with_retries(ctx: WorkerContext, job_id: str, index: int) -> ShardOutcome:
    """Until the shard is done. A lease lost (its heartbeats starved on a loaded machine, or
    the database away for longer than the lease) or held by another process means no broker
    will bring the shard back here: try again, which resumes it once the lease is free, or
    finds it finished by whoever held it."""
    while True:
        try:
            outcome = run_shard(ctx, job_id, index)
        except RetryShard as exc:
            log.warning("shard %d failed (%s); retrying", index, exc)
        except DependencyUnavailable as exc:
            log.warning("%s; still waiting", exc)  # no broker to hand it back to: wait on
            continue
        else:
            if outcome.status != "lease_lost" and outcome.reason != ANOTHER_HOLDS_IT:
                return outcome
            log.warning("shard %d: %s; trying again", index, outcome.reason or outcome.status)
        time.sleep(RETRY_SECONDS)


def run_job(
    settings: Settings,
    source: InputSource,
    model: str,
    *,
    shard_size: int | None = None,
    priority: int | None = None,
    input_format: str | None = None,
    shard_order: str | None = None,
    concurrency: int | None = None,
    on_start: Callable[[dict[str, Any]], None] | None = None,
    on_items: Callable[[int], None] | None = None,
    host_factory: Callable[[], EngineHost] | None = None,
    submit_options: dict[str, Any] | None = None,
    on_records: Callable[[Sequence[ItemRecord]], None] | None = None,
    on_loading: Callable[[], None] | None = None,
    on_loaded: Callable[[float, bool], None] | None = None,
) -> dict[str, Any]:
    """Submit ``source`` without a broker, run every shard here, return the final job.
    ``on_start(job)`` runs once the input is validated (e.g. to size a progress bar).
    Ctrl-C cancels the job (results so far are kept) and re-raises. ``submit_options``: more
    of ``Client.submit``'s keywords (the request options); ``chat`` left to auto is decided
    here, where the model is loaded, so the job shows what was done. ``on_records(records)``:
    items newly stored (tokens and all); ``on_loading()`` before the model loads and
    ``on_loaded(seconds, has_chat_template)`` after."""
    if concurrency is not None and not 1 <= concurrency <= 256:
        raise ValueError(f"concurrency must be from 1 to 256, got {concurrency}")
    if isinstance(source, (str, os.PathLike)) and not Path(source).expanduser().is_file():
        raise FileNotFoundError(f"input file {str(source)!r} does not exist or is not a file")
    # Bad options, and an input whose start shows it cannot be a job (a CSV header without a
    # prompt column), are named before the model loads (seconds to minutes).
    request_options = RequestOptions.from_fields(**(submit_options or {}))
    request_options.check(settings.input_limits())
    if isinstance(source, (str, os.PathLike)):
        fmt = InputFormat(input_format) if input_format is not None else None
        check_input_start(Path(source).expanduser(), settings.input_limits(), fmt, request_options)
    client = Client(settings)
    ctx: WorkerContext | None = None
    try:
        ctx = WorkerContext.create(settings, model, on_items=on_items, host_factory=host_factory)
        if on_records is not None:
            ctx.item_listeners.append(on_records)
        if on_loading is not None:
            on_loading()
        loading = time.monotonic()
        host = ctx.host()  # load the model first: a model that cannot load is an error, not a job
        has_template = bool(getattr(host.tokenizer, "chat_template", None))
        if on_loaded is not None:
            on_loaded(time.monotonic() - loading, has_template)
        options = dict(submit_options or {})
        if options.get("chat") is None:
            options["chat"] = has_template
        elif options["chat"] and not has_template:
            raise ValueError(
                f"--chat: model {model} has no chat template; run it with --no-chat, or leave chat to auto"
            )
        created: list[str] = []
        try:
            job = client.submit(
                source, model, shard_size, priority, input_format=input_format, enqueue=False,
                on_created=created.append, shard_order=shard_order, **options,
            )  # fmt: skip
            if JobStatus(job["status"]).terminal:
                if on_start is not None:
                    on_start(job)
                deliver_webhooks(settings, client)
                return job
            _run_shards(client, ctx, job, concurrency or settings.worker_concurrency, on_start)
        except KeyboardInterrupt:
            # Ctrl-C may land anywhere once the job exists, even before ``on_start``: cancel it
            # (idempotent) and name it, unless it never got past validation (then it failed).
            if not created or client.cancel(created[0])["status"] == JobStatus.failed.value:
                raise
            raise RunInterrupted(created[0]) from None
        finalize_if_ready(client.db, client.store, job["id"], heartbeat_seconds=settings.heartbeat_seconds)
        deliver_webhooks(settings, client)
        return client.status(job["id"])
    finally:
        if ctx is not None:
            ctx.close()
        client.close()


def deliver_webhooks(settings: Settings, client: Client) -> None:
    """The job's end goes out to the webhooks before this short-lived process exits, for up to
    ``CONVEYOR_WEBHOOK_DRAIN_SECONDS``; what is still failing then stays in the outbox, for the
    next ``conveyor serve``, worker or run on the same database to deliver."""
    dispatcher = WebhookDispatcher(client.db, settings)
    try:
        if not dispatcher.drain(settings.webhook_drain_seconds):
            log.warning("conveyor run: some webhooks are not delivered yet; they stay queued (see conveyor webhooks)")
    finally:
        dispatcher.close()


def _run_shards(
    client: Client,
    ctx: WorkerContext,
    job: dict[str, Any],
    concurrency: int,
    on_start: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Every shard of ``job`` on a thread pool. Ctrl-C at any point cancels the job first (the
    running shards then stop within ``cancel_poll_seconds``, keeping what finished) and only
    then waits for them; shards not started yet never start."""
    pool = ThreadPoolExecutor(max(1, min(concurrency, job["num_shards"])), thread_name_prefix="conveyor-shard")
    try:
        if on_start is not None:
            on_start(job)
        futures = [pool.submit(_run_with_retries, ctx, job["id"], i) for i in range(job["num_shards"])]
        for future in futures:
            future.result()
    except KeyboardInterrupt:
        ctx.abort_running_on_cancel = True  # the user wants out now, not after the running lines
        client.cancel(job["id"])
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
