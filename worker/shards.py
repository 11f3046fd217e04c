"""Running one shard: lease, feed the engine host, store items as they finish, part files.

A shard task first takes the shard's lease (compare-and-set); if another live worker holds
it, or the shard is already done, the task just returns (a redelivered message). While it
runs, a background thread renews the lease. Items already stored (an earlier attempt got
that far) are skipped; all the others go into the shared engine host at once, next to the
items of every other shard this process runs. Finished items are written in batches
(``item_commit_batch`` items or ``item_commit_interval_seconds``, whichever comes first).
Every ``cancel_poll_seconds`` the job's status is read: on a cancel the shard aborts its
in-flight items and stops, keeping what finished. At the end the shard's part files are
written from the database, the lease is released, and whoever finishes the job's last
shard finalises the job.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from worker import keys
from worker.completions import (
    ItemContext,
    clean_text,
    completion_record,
    engine_prompt,
    error_record,
    sampling_params,
)
from worker.context import WorkerContext
from worker.finalize import finalize_if_ready
from worker.formats import ParsedRequest
from worker.parts import write_shard_parts
from worker.runtime import Completion, RequestHandle
from worker.store.db import Job, JobStatus, Shard, ShardStatus, make_sessionmaker
from worker.store.items import ItemRecord, record_finished_items, refresh_job_counts, stored_custom_ids
from worker.store.leases import LeaseLost, acquire_lease, heartbeat_lease, new_lease_owner, release_lease

log = logging.getLogger(__name__)

STOPPING = (JobStatus.cancelling, JobStatus.cancelled, JobStatus.failed)
DRAIN_SECONDS = 30.0  # how long a cancelled shard waits for its aborted items to come back


class RetryShard(Exception):
    """The shard failed this attempt and was handed back (``pending``); run it again later."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class ShardOutcome:
    job_id: str
    shard_index: int
    status: str  # completed | cancelled | failed | skipped | lease_lost
    items: int = 0  # items newly stored by this run
    finalized: bool = False
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "shard_index": self.shard_index, "status": self.status,
            "items": self.items, "finalized": self.finalized, "reason": self.reason,
        }  # fmt: skip


class LeaseKeeper:
    """Renews a shard's lease every ``every`` seconds in a background thread; ``lost`` is
    set once the lease is gone (taken over, or not renewed for a whole lease period)."""

    def __init__(self, ctx: WorkerContext, job_id: str, shard_index: int, owner: str) -> None:
        self._ctx, self._job_id, self._index, self._owner = ctx, job_id, shard_index, owner
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id[-6:]}-{shard_index}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        s = self._ctx.settings
        last_ok = time.monotonic()
        while not self._stop.wait(s.heartbeat_seconds):
            try:
                ok = heartbeat_lease(self._ctx.db, self._job_id, self._index, self._owner, s.lease_seconds)
            except Exception:  # noqa: BLE001 - a DB hiccup: try again next beat
                log.warning("lease heartbeat failed for shard %s/%d", self._job_id, self._index, exc_info=True)
                ok = time.monotonic() - last_ok < s.lease_seconds
            else:
                last_ok = time.monotonic() if ok else last_ok
            if not ok:
                log.warning("lost the lease on shard %s/%d", self._job_id, self._index)
                self.lost.set()
                return


class _ItemBuffer:
    """Finished items waiting for their batched commit."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._items: list[ItemRecord] = []
        self._since = time.monotonic()
        self.stored = 0

    def add(self, record: ItemRecord) -> None:
        if not self._items:
            self._since = time.monotonic()
        self._items.append(record)

    def due(self) -> bool:
        s = self._ctx.settings
        return len(self._items) >= s.item_commit_batch or (
            bool(self._items) and time.monotonic() - self._since >= s.item_commit_interval_seconds
        )

    def flush(self) -> None:
        if not self._items:
            return
        new = record_finished_items(self._ctx.db, self._items)
        self._items = []
        self.stored += len(new)
        if new and self._ctx.on_items is not None:
            self._ctx.on_items(len(new))


class ShardRunner:
    def __init__(self, ctx: WorkerContext, job_id: str, shard_index: int) -> None:
        self.ctx, self.job_id, self.index = ctx, job_id, shard_index
        self.owner = new_lease_owner()
        self._handles: dict[str, RequestHandle] = {}
        self._aborted = False

    def _outcome(self, status: str, items: int = 0, reason: str = "", finalized: bool = False) -> ShardOutcome:
        return ShardOutcome(self.job_id, self.index, status, items, finalized, reason)

    # ---- entry point ------------------------------------------------------------------

    def run(self) -> ShardOutcome:
        ctx = self.ctx
        with ctx.db.connect() as conn:
            job = conn.execute(select(Job.status, Job.model, Job.priority).where(Job.id == self.job_id)).one_or_none()
        if job is None:
            return self._outcome("skipped", reason="no such job")
        if JobStatus(job.status).terminal:
            return self._outcome("skipped", reason=f"job is {JobStatus(job.status).value}")
        if job.model != ctx.model:
            log.error("shard %s/%d is for model %s but this worker serves %s", self.job_id, self.index, job.model, ctx.model)
            return self._outcome("skipped", reason=f"job is for model {job.model}")
        if not acquire_lease(ctx.db, self.job_id, self.index, self.owner, ctx.settings.lease_seconds):
            return self._after_skip()
        shard = self._shard()
        if JobStatus(job.status) in STOPPING:
            return self._finish(ShardStatus.cancelled, 0)
        if shard.attempts > ctx.settings.shard_max_attempts:
            return self._give_up(shard.error or "too many attempts", 0)
        buffer = _ItemBuffer(ctx)
        with LeaseKeeper(ctx, self.job_id, self.index, self.owner) as keeper:
            try:
                cancelled = self._execute(job.priority, buffer, keeper)
            except LeaseLost as exc:
                self._abort_all()
                log.warning("%s; leaving the shard to its new owner", exc)
                return self._outcome("lease_lost", buffer.stored, str(exc))
            except Exception as exc:
                self._abort_all()
                return self._failed_attempt(exc, shard.attempts, buffer)
        return self._finish(ShardStatus.cancelled if cancelled else ShardStatus.completed, buffer.stored)

    def _shard(self) -> Shard:
        with make_sessionmaker(self.ctx.db)() as session:
            shard = session.get(Shard, (self.job_id, self.index))
            if shard is None:
                raise LookupError(f"job {self.job_id} has no shard {self.index}")
            return shard

    def _after_skip(self) -> ShardOutcome:
        """Not our lease: another worker runs it, or it is done (then maybe the job is)."""
        status = ShardStatus(self._shard().status)
        if status in (ShardStatus.pending, ShardStatus.running):
            return self._outcome("skipped", reason="another worker holds the lease")
        result = finalize_if_ready(self.ctx.db, self.ctx.store, self.job_id, heartbeat_seconds=self.ctx.settings.heartbeat_seconds)
        return self._outcome("skipped", reason=f"shard already {status.value}", finalized=result is not None)

    # ---- the work -----------------------------------------------------------------------

    def _requests(self) -> list[ParsedRequest]:
        stream = self.ctx.job_store(self.job_id).open_read(keys.shard_input_key(self.index))
        with stream:
            return [ParsedRequest.from_json(json.loads(line)) for line in stream if line.strip()]

    def _execute(self, priority: int, buffer: _ItemBuffer, keeper: LeaseKeeper) -> bool:
        """Run the shard's remaining items; True if the job was cancelled meanwhile."""
        ctx = self.ctx
        s = ctx.settings
        done = stored_custom_ids(ctx.db, self.job_id, self.index)
        item_ctx = ItemContext(self.job_id, ctx.model, self.index, ctx.worker_id)
        finished: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        host = ctx.host()
        for req in self._requests():
            if req.custom_id in done:
                continue
            try:
                params = sampling_params(req)
            except ValueError as exc:
                buffer.add(error_record(item_ctx, req, code="invalid_value", message=str(exc), status_code=400))
                continue
            handle = host.submit(engine_prompt(req), params, priority=priority, tag=req, on_done=finished.put)
            self._handles[handle.request_id] = handle
        token_text = _token_text(host.tokenizer)
        next_poll = time.monotonic() + s.cancel_poll_seconds
        drain_deadline: float | None = None
        while self._handles:
            try:
                handle = finished.get(timeout=min(s.item_commit_interval_seconds, s.cancel_poll_seconds))
            except queue.Empty:
                handle = None
            if handle is not None and self._handles.pop(handle.request_id, None) is not None:
                record = self._record(item_ctx, handle, token_text)
                if record is not None:
                    buffer.add(record)
            if buffer.due():
                buffer.flush()
            if keeper.lost.is_set():
                raise LeaseLost(f"lease on shard {self.index} of job {self.job_id} was lost")
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + s.cancel_poll_seconds
                if not self._aborted and self._job_stopping():
                    log.info("job %s cancelled: aborting %d items of shard %d", self.job_id, len(self._handles), self.index)
                    self._abort_all()
                    drain_deadline = time.monotonic() + DRAIN_SECONDS
            if drain_deadline is not None and time.monotonic() > drain_deadline:
                log.warning("shard %s/%d: %d aborted items never came back", self.job_id, self.index, len(self._handles))
                break
        buffer.flush()
        return self._aborted

    def _record(self, item_ctx: ItemContext, handle: RequestHandle, token_text: Any) -> ItemRecord | None:
        req: ParsedRequest = handle.tag
        try:
            completion: Completion = handle.future.result()
        except Exception as exc:  # noqa: BLE001 - EngineFailure, HostClosed: the item failed
            return error_record(item_ctx, req, code="engine_error", message=str(exc), status_code=500)
        if completion.aborted:
            if self._aborted:
                return None  # cancelled: not a result
            return error_record(item_ctx, req, code="aborted", message="the engine aborted the request", status_code=500)
        return completion_record(item_ctx, req, completion, token_text)

    def _job_stopping(self) -> bool:
        with self.ctx.db.connect() as conn:
            status = conn.execute(select(Job.status).where(Job.id == self.job_id)).scalar_one_or_none()
        return status is None or JobStatus(status) in STOPPING

    def _abort_all(self) -> None:
        self._aborted = True
        if not self._handles:
            return
        host = self.ctx.host()
        for handle in list(self._handles.values()):
            host.abort(handle)

    # ---- endings ------------------------------------------------------------------------

    def _finish(self, status: ShardStatus, stored: int) -> ShardOutcome:
        ctx = self.ctx
        results_uri, errors_uri = write_shard_parts(ctx.db, ctx.job_store(self.job_id), self.job_id, self.index)
        if not release_lease(ctx.db, self.job_id, self.index, self.owner, status, output_uri=results_uri, error_uri=errors_uri):
            return self._outcome("lease_lost", stored, "the lease expired before the shard was released")
        refresh_job_counts(ctx.db, self.job_id)
        result = finalize_if_ready(ctx.db, ctx.store, self.job_id, heartbeat_seconds=ctx.settings.heartbeat_seconds)
        return self._outcome(status.value, stored, finalized=result is not None)

    def _failed_attempt(self, exc: Exception, attempts: int, buffer: _ItemBuffer) -> ShardOutcome:
        message = f"{type(exc).__name__}: {exc}"
        log.error("shard %s/%d attempt %d failed: %s", self.job_id, self.index, attempts, message, exc_info=exc)
        try:
            buffer.flush()  # keep what finished
        except Exception:  # noqa: BLE001
            log.warning("could not store finished items of the failed attempt", exc_info=True)
        if attempts < self.ctx.settings.shard_max_attempts:
            release_lease(self.ctx.db, self.job_id, self.index, self.owner, ShardStatus.pending, error=message[:2000])
            raise RetryShard(message, attempts) from exc
        return self._give_up(message, buffer.stored)

    def _give_up(self, message: str, stored: int) -> ShardOutcome:
        """Out of attempts: every item not stored yet becomes a failed item; the job goes on."""
        ctx = self.ctx
        item_ctx = ItemContext(self.job_id, ctx.model, self.index, ctx.worker_id)
        done = stored_custom_ids(ctx.db, self.job_id, self.index)
        text = f"the shard failed {ctx.settings.shard_max_attempts} times; last error: {message}"[:2000]
        records = [
            error_record(item_ctx, req, code="shard_failed", message=text, status_code=500)
            for req in self._requests()
            if req.custom_id not in done
        ]
        for start in range(0, len(records), 1000):
            record_finished_items(ctx.db, records[start : start + 1000])
        outcome = self._finish(ShardStatus.failed, stored + len(records))
        return ShardOutcome(outcome.job_id, outcome.shard_index, outcome.status, outcome.items, outcome.finalized, text)


def _token_text(tokenizer: Any):
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = clean_text(tokenizer.decode([token_id]))
        return cache[token_id]

    return text


def run_shard(ctx: WorkerContext, job_id: str, shard_index: int) -> ShardOutcome:
    """Run one shard (``RetryShard`` if this attempt failed and the shard should run again)."""
    keys.check_job_id(job_id)
    return ShardRunner(ctx, job_id, shard_index).run()
