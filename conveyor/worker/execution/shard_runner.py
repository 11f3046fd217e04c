"""Running one shard: lease, feed the engine host, store items as they finish, part files.

A shard task first takes the shard's lease (compare-and-set); if another live worker holds
it, or the shard is already done, the task just returns (a redelivered message). While it
runs, a background thread renews the lease. Items already stored (an earlier attempt got
that far) are skipped; all the others go into the shared engine host at once, next to the
items of every other shard this process runs. Finished items are written in batches
(``item_commit_batch`` items or ``item_commit_interval_seconds``, whichever comes first).
Every ``cancel_poll_seconds`` the job's status is read: on a cancel the shard withdraws the
items the engine has not started, lets those it runs finish (they are kept), and stops.
At the end the shard's part files are written from the database, the lease is released,
and whoever finishes the job's last shard finalises the job.

Three kinds of trouble, three answers, and only the second is ever the items' fault:

- A dependency fault (the database or the object store unreachable) is waited out through
  the process's ``DependencyGate``, never counted. No shard starts while a dependency is
  down; a running shard keeps its lease, keeps the engine going and holds its finished
  items until the database is back; a step that failed is redone once it is. A task
  that has not taken its lease yet hands its message back to the broker after
  ``dependency_retry_seconds`` of outage.
- An error raised in the worker is a failed attempt (``shards.failures``): retried with
  backoff up to ``shard_max_attempts``, then the unstored items become ``shard_failed``.
- A worker death is no attempt at all. The next holder finds ``shards.deaths`` above zero
  and runs the remaining items as suspects: in groups that halve with each death, one group
  at a time per process (the quarantine lane, ``WorkerContext.quarantine``), so an item that
  kills its worker soon runs alone. Only deaths while it ran alone count against an item
  (``store/crashes.py``); at ``item_max_crashes`` it alone becomes a ``worker_crashed``
  error and the rest of the shard completes.

A worker that is stopping (``ProcessState``: SIGTERM, or ``--exit-when-idle``) takes no new
shard, and at its hand-back time a running shard aborts what is still in the engine, stores
what finished and releases its lease as ``pending``, counting nothing: another worker takes
it over at once and runs only what was not stored (outcome ``handed_back``: the task puts its
message back on the queue).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import select

from conveyor.engine.sample.token_pieces import TokenPieces
from conveyor.worker.batchio.records import ParsedRequest
from conveyor.worker.core.periodic import Periodic
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.dependency_gate import DependencyUnavailable
from conveyor.worker.execution.embedding_records import embedding_record
from conveyor.worker.execution.engine_host import Completion, RequestHandle
from conveyor.worker.execution.item_records import (
    ItemContext,
    completion_record,
    engine_prompt,
    error_record,
    sampling_params,
)
from conveyor.worker.execution.reasoning import NO_REASONING, reasoning_of
from conveyor.worker.execution.score_records import score_record
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.cache_salt import cache_salt
from conveyor.worker.jobs.finalize import finalize_if_ready
from conveyor.worker.jobs.output_files import write_shard_parts
from conveyor.worker.jobs.shard_choice import another_owner_waiting
from conveyor.worker.store.crashes import crash_counts, set_solo_item
from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.items import ItemRecord, record_finished_items, record_shard_counts, stored_custom_ids
from conveyor.worker.store.leases import LeaseLost, acquire_lease, heartbeat_lease, new_lease_owner, release_lease
from conveyor.worker.store.models import Job, JobStatus, Shard, ShardStatus

log = logging.getLogger(__name__)

T = TypeVar("T")

STOPPING = (JobStatus.cancelling, JobStatus.cancelled, JobStatus.failed, JobStatus.expired)
DRAIN_SECONDS = 30.0  # how long a shard that aborted its running items waits for them to come back
HAND_BACK_WAIT_SECONDS = 2.0  # how long a shard handed back waits for its aborted items


class HandBack(Exception):
    """The worker is stopping: give the shard back, keeping what finished."""


class RetryShard(Exception):
    """The shard failed this attempt and was handed back (``pending``); run it again later.
    ``attempts``: the failed attempts so far."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class _Order:
    """What orders a job's items in the engine: the job's priority, and its deadline (its
    ``expires_at``, created_at + completion window; None for a job without one). Under the
    worker's default ``priority`` policy the priority comes first and the deadline breaks
    ties, so among jobs of equal priority the one due soonest is served first; but only
    among one owner's jobs: the engine host's ``FairFeed`` takes turns between owners first."""

    priority: int
    deadline: float | None
    owner: str = ""  # the job's API key id ("" for none): the engine host shares the engine between owners


ANOTHER_HOLDS_IT = "another worker holds the lease"


def shard_label(job_id: str, shard_index: int) -> str:
    """A shard's name in logs, and in ``OwnerSlots``' record of the shard giving its place back."""
    return f"shard {job_id}/{shard_index}"


@dataclass(frozen=True)
class ShardOutcome:
    job_id: str
    shard_index: int
    status: str  # completed | cancelled | failed | skipped | lease_lost | handed_back
    items: int = 0  # items newly stored by this run
    finalized: bool = False
    reason: str = ""
    yielded: bool = False  # handed back to give its place to another owner's work

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "shard_index": self.shard_index, "status": self.status,
            "items": self.items, "finalized": self.finalized, "reason": self.reason, "yielded": self.yielded,
        }  # fmt: skip


class LeaseKeeper:
    """Renews a shard's lease every ``heartbeat_seconds`` on a ``Periodic`` thread; ``lost``
    is set once the lease is gone: taken over, or not renewed for a whole lease period for a
    reason other than the database being down. While the database is down nobody can take
    the lease over, so the shard goes on; the first renewal that reaches it tells."""

    def __init__(self, ctx: WorkerContext, job_id: str, shard_index: int, owner: str) -> None:
        self._ctx, self._job_id, self._index, self._owner = ctx, job_id, shard_index, owner
        self.lost = threading.Event()
        self._last_ok = time.monotonic()
        name = f"lease-{job_id[-6:]}-{shard_index}"
        self._beat = Periodic(name, ctx.settings.heartbeat_seconds, self._renew, run_first=False)

    def __enter__(self) -> LeaseKeeper:
        self._beat.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._beat.stop()

    def _renew(self) -> None:
        s = self._ctx.settings
        try:
            ok = heartbeat_lease(self._ctx.db, self._job_id, self._index, self._owner, s.lease_seconds)
        except Exception as exc:
            if self._ctx.gate.report(exc) is not None:
                return
            log.warning("lease heartbeat failed for shard %s/%d", self._job_id, self._index, exc_info=True)
            ok = time.monotonic() - self._last_ok < s.lease_seconds
        else:
            self._last_ok = time.monotonic() if ok else self._last_ok
        if not ok:
            log.warning("lost the lease on shard %s/%d", self._job_id, self._index)
            self.lost.set()
            self._beat.stop()  # from its own thread: ends the loop without a join


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
        items, new = self._items, record_finished_items(self._ctx.db, self._items)
        self._items = []
        self.stored += len(new)
        self._ctx.items_stored(_newly_stored(items, new))


class ShardRunner:
    def __init__(self, ctx: WorkerContext, job_id: str, shard_index: int) -> None:
        self.ctx, self.job_id, self.index = ctx, job_id, shard_index
        self.owner = new_lease_owner()
        self.name = shard_label(job_id, shard_index)
        self._handles: dict[str, RequestHandle] = {}
        self._cancelled = False  # the job was cancelled: aborted items are not results
        self._handing_back = False  # the worker is stopping: aborted items are not results either
        self._yielding = False  # handing back to give the place to another owner (the worker stays)
        self._buffer = _ItemBuffer(ctx)  # kept across retries: finished items survive an outage
        self._item_ctx = ItemContext(job_id, ctx.model, shard_index, ctx.worker_id)
        self._flush_after = 0.0
        self._parts: str | None = None  # the results part file, once written
        self._cache_salt: str | None = None  # whose prefix-cache blocks the items may reuse
        self._reasoning = NO_REASONING  # the worker's reasoning parser, set when items run
        self._released = False
        self._reason = ""

    def _outcome(self, status: str, items: int = 0, reason: str = "", finalized: bool = False) -> ShardOutcome:
        return ShardOutcome(self.job_id, self.index, status, items, finalized, reason)

    def _call(self, fn: Callable[[], T], stop: Callable[[], bool] | None = None, *, holding: bool = False) -> T:
        """``fn()``, waiting out database and storage outages (``DependencyGate.call``).

        Before the lease, for ``dependency_retry_seconds`` (then the message goes back to the
        broker: nothing is held). Holding the lease (``holding``), until the dependency is
        back: handing back work in progress would only have it redone, and a lease that could
        not be released would wait out its expiry and a sweep. (When jobs get an expiry,
        that is where both waits end.)"""
        state = self.ctx.state
        patience = math.inf if holding else self.ctx.settings.dependency_retry_seconds
        give_up = state.hand_back_due if holding else lambda: state.draining
        return self.ctx.gate.call(fn, what=self.name, patience=patience, stop=stop, give_up=give_up)

    # ---- entry point ------------------------------------------------------------------

    def run(self) -> ShardOutcome:
        """Run the shard: ``RetryShard`` after a failed attempt; ``DependencyUnavailable``
        when a dependency stayed down ``dependency_retry_seconds`` (nothing counted)."""
        return self._call(self._run_once)

    def _run_once(self) -> ShardOutcome:
        ctx = self.ctx
        with ctx.db.connect() as conn:
            job = conn.execute(
                select(Job.status, Job.model, Job.model_name, Job.priority, Job.expires_at, Job.owner).where(
                    Job.id == self.job_id
                )
            ).one_or_none()
        if job is None:
            return self._outcome("skipped", reason="no such job")
        self._cache_salt = cache_salt(ctx.settings, self.job_id, job.owner)
        if JobStatus(job.status).terminal:
            return self._outcome("skipped", reason=f"job is {JobStatus(job.status).value}")
        if job.model != ctx.model:
            log.error(
                "shard %s/%d is for model %s but this worker serves %s", self.job_id, self.index, job.model, ctx.model
            )
            return self._outcome("skipped", reason=f"job is for model {job.model}")
        if ctx.state.draining:
            return self._outcome("handed_back", reason="the worker is stopping")
        # Results name the model as the job did (the served name, or the path as typed).
        self._item_ctx = dataclasses.replace(self._item_ctx, model=job.model_name or job.model)
        if not acquire_lease(ctx.db, self.job_id, self.index, self.owner, ctx.settings.lease_seconds):
            return self._after_skip()
        shard = self._shard()
        failure: Exception | None = None
        handed_back = False
        with LeaseKeeper(ctx, self.job_id, self.index, self.owner) as keeper:
            try:
                status = self._call(
                    lambda: self._work(
                        job.status, _Order(job.priority, job.expires_at, job.owner or ""), shard, keeper
                    ),
                    keeper.lost.is_set,
                    holding=True,
                )
            except LeaseLost as exc:
                self._abort_all()
                log.warning("%s; leaving the shard to its new owner", exc)
                return self._outcome("lease_lost", self._buffer.stored, str(exc))
            except HandBack:
                self._abort_all()
                handed_back = True
            except DependencyUnavailable:
                self._abort_all()  # stopping while a dependency is down: the lease expires instead
                raise
            except Exception as exc:
                self._abort_all()
                failure = exc
        if handed_back:
            return self._hand_back()
        if failure is not None:
            return self._failed_attempt(failure, shard)
        return self._call(lambda: self._release(status), holding=True)

    def _hand_back(self) -> ShardOutcome:
        """Release the lease as ``pending`` (nothing counted) so another worker resumes now."""
        released = self._call(
            lambda: release_lease(self.ctx.db, self.job_id, self.index, self.owner, ShardStatus.pending),
            holding=True,
        )
        why = "its place went to another owner" if self._yielding else "the worker is stopping"
        log.info("%s: handed back (%s); %d items stored by it", self.name, why, self._buffer.stored)
        reason = why if released else f"{why} (the lease was gone)"
        outcome = self._outcome("handed_back", self._buffer.stored, reason)
        return dataclasses.replace(outcome, yielded=self._yielding)

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
            return self._outcome("skipped", reason=ANOTHER_HOLDS_IT)
        result = finalize_if_ready(
            self.ctx.db, self.ctx.store, self.job_id, heartbeat_seconds=self.ctx.settings.heartbeat_seconds
        )
        return self._outcome("skipped", reason=f"shard already {status.value}", finalized=result is not None)

    # ---- the work (under the lease; redone from the top after a dependency fault) -------

    def _work(self, job_status: JobStatus, order: _Order, shard: Shard, keeper: LeaseKeeper) -> ShardStatus:
        """Run what is left of the shard and write its part files; the status to release."""
        if keeper.lost.is_set():
            raise LeaseLost(f"lease on shard {self.index} of job {self.job_id} was lost")
        self._buffer.flush()  # what an attempt interrupted by an outage had finished
        if JobStatus(job_status) in STOPPING:
            status = ShardStatus.cancelled
        elif shard.failures >= self.ctx.settings.shard_max_attempts:
            self._fail_unstored(shard.error or "too many attempts")
            status = ShardStatus.failed
        else:
            cancelled = self._execute(order, shard, keeper)
            status = ShardStatus.cancelled if cancelled else ShardStatus.completed
        self._parts = write_shard_parts(self.ctx.db, self.ctx.job_store(self.job_id), self.job_id, self.index)
        return status

    def _requests(self) -> list[ParsedRequest]:
        stream = self.ctx.job_store(self.job_id).open_read(object_keys.shard_input_key(self.index))
        with stream:
            return [ParsedRequest.from_json(json.loads(line)) for line in stream if line.strip()]

    def _execute(self, order: _Order, shard: Shard, keeper: LeaseKeeper) -> bool:
        """Run the shard's remaining items; True if the job was cancelled meanwhile."""
        done = stored_custom_ids(self.ctx.db, self.job_id, self.index)
        todo = [req for req in self._requests() if req.custom_id not in done]
        if shard.deaths == 0:
            return self._run_items(todo, order, keeper)
        return self._run_suspects(todo, order, shard.deaths, keeper)

    def _run_suspects(self, todo: list[ParsedRequest], order: _Order, deaths: int, keeper: LeaseKeeper) -> bool:
        """A worker died holding this shard: its remaining items are suspects. They run in
        groups of ``remaining / 2**deaths`` (alone after a few deaths), one group at a time in
        this process's quarantine lane, so the item that kills workers ends up alone and is
        charged (``store/crashes.py``); an item charged ``item_max_crashes`` times is an error."""
        s = self.ctx.settings
        crashes = crash_counts(self.ctx.db, self.job_id, self.index)
        suspects: list[ParsedRequest] = []
        for req in todo:
            count = crashes.get(req.custom_id, 0)
            if count < s.item_max_crashes:
                suspects.append(req)
                continue
            log.error(
                "%s: item %r killed its worker %d times running alone: an error now", self.name, req.custom_id, count
            )
            message = (
                f"the worker process died {count} times while running this request alone "
                "(it crashes the worker); it is not run again"
            )
            self._buffer.add(error_record(self._item_ctx, req, code="worker_crashed", message=message, status_code=500))
        self._buffer.flush()
        if not suspects:
            return False
        size = max(1, math.ceil(len(suspects) / 2**deaths))
        log.warning(
            "%s: its worker died %d time(s); running its %d remaining items in groups of %d, "
            "one group at a time in this process", self.name, deaths, len(suspects), size,
        )  # fmt: skip
        for start in range(0, len(suspects), size):
            group = suspects[start : start + size]
            if self.ctx.state.draining:  # a suspect group may kill its worker: leave it to one that stays
                raise HandBack()
            if not self._enter_quarantine(keeper):
                return True
            try:
                solo = group[0].custom_id if len(group) == 1 else None
                set_solo_item(self.ctx.db, self.job_id, self.index, self.owner, solo)
                if self._run_items(group, order, keeper):
                    return True
            finally:
                self.ctx.quarantine.release()
        return False

    def _enter_quarantine(self, keeper: LeaseKeeper) -> bool:
        """Wait for the process's quarantine lane; False if the job was cancelled meanwhile."""
        next_poll = time.monotonic() + self.ctx.settings.cancel_poll_seconds
        while not self.ctx.quarantine.acquire(timeout=0.2):
            if self.ctx.state.hand_back_due():
                raise HandBack()
            if keeper.lost.is_set():
                raise LeaseLost(f"lease on shard {self.index} of job {self.job_id} was lost")
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.ctx.settings.cancel_poll_seconds
                if self._job_stopping():
                    self._cancelled = True
                    return False
        return True

    def _run_items(self, requests: list[ParsedRequest], order: _Order, keeper: LeaseKeeper) -> bool:
        """Put ``requests`` into the engine at once and store them as they finish; True if
        the job was cancelled meanwhile."""
        ctx = self.ctx
        s = ctx.settings
        finished: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        host = ctx.host()
        chat_template = bool(getattr(host.tokenizer, "chat_template", None))
        reasoning = self._reasoning = reasoning_of(host, s)
        self._handles = {}
        for req in requests:
            try:
                params = sampling_params(req, self._cache_salt, reasoning)
                prompt = engine_prompt(req, chat_template=chat_template, reasoning=reasoning)
            except ValueError as exc:
                self._buffer.add(
                    error_record(self._item_ctx, req, code="invalid_value", message=str(exc), status_code=400)
                )
                continue
            handle = host.submit(
                prompt,
                params,
                priority=order.priority,
                deadline=order.deadline,
                tag=req,
                on_done=finished.put,
                owner=order.owner,
            )
            self._handles[handle.request_id] = handle
        pieces = TokenPieces(host.tokenizer)
        decode = _decode(host.tokenizer)
        next_poll = time.monotonic() + s.cancel_poll_seconds
        drain_deadline: float | None = None
        while self._handles:
            try:
                finished_handle: RequestHandle | None = finished.get(
                    timeout=min(s.item_commit_interval_seconds, s.cancel_poll_seconds)
                )
            except queue.Empty:
                finished_handle = None
            if finished_handle is not None and self._handles.pop(finished_handle.request_id, None) is not None:
                record = self._record(finished_handle, pieces, decode)
                if record is not None:
                    self._buffer.add(record)
            if self._buffer.due():
                self._flush_through_outages()
            if keeper.lost.is_set():
                raise LeaseLost(f"lease on shard {self.index} of job {self.job_id} was lost")
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + s.cancel_poll_seconds
                if not self._cancelled and self._job_stopping():
                    log.info(
                        "job %s cancelled: withdrawing the items of shard %d not yet running, of %d left",
                        self.job_id,
                        self.index,
                        len(self._handles),
                    )
                    self._cancelled = True
                    if ctx.abort_running_on_cancel:
                        self._abort_all()
                        drain_deadline = time.monotonic() + DRAIN_SECONDS
                    # Those the engine runs finish and are kept; the rest come back aborted.
                    for handle in self._handles.values():
                        host.withdraw(handle)
                if not self._handing_back and not self._cancelled and self._place_owed(order.owner):
                    log.info(
                        "%s: owner holds every place while another owner's work waits: handing back %d items",
                        self.name,
                        len(self._handles),
                    )
                    self._yielding = True
            if not self._handing_back and not self._cancelled and (self._yielding or ctx.state.hand_back_due()):
                if not self._yielding:
                    log.info("%s: the worker is stopping: aborting its %d running items", self.name, len(self._handles))
                self._handing_back = True
                for handle in self._handles.values():  # kept: those that finished first still come back
                    host.abort(handle)
                drain_deadline = time.monotonic() + HAND_BACK_WAIT_SECONDS
            if drain_deadline is not None and time.monotonic() > drain_deadline:
                log.warning("%s: %d aborted items never came back", self.name, len(self._handles))
                break
        self._buffer.flush()
        if self._handing_back:
            raise HandBack()
        return self._cancelled

    def _flush_through_outages(self) -> None:
        """Store finished items; while the database is down keep them and the engine going."""
        if time.monotonic() < self._flush_after:
            return
        try:
            self._buffer.flush()
        except Exception as exc:
            if self.ctx.gate.report(exc) is None:
                raise
            self._flush_after = time.monotonic() + 1.0

    def _record(self, handle: RequestHandle, pieces: TokenPieces, decode: Any) -> ItemRecord | None:
        req: ParsedRequest = handle.tag
        try:
            completion: Completion = handle.future.result()
        except Exception as exc:
            return error_record(self._item_ctx, req, code="engine_error", message=str(exc), status_code=500)
        if completion.aborted:
            if self._cancelled or self._handing_back:
                return None  # cancelled, or handed back to run elsewhere: not a result
            return error_record(
                self._item_ctx, req, code="aborted", message="the engine aborted the request", status_code=500
            )
        if req.inputs is not None:
            return embedding_record(self._item_ctx, req, completion)
        if req.pairs is not None:
            return score_record(self._item_ctx, req, completion)
        return completion_record(self._item_ctx, req, completion, pieces, decode, self._reasoning)

    def _place_owed(self, owner: str) -> bool:
        """Whether this shard should give its place back: its owner holds every place of the
        worker while another owner has a shard of the model waiting (then this shard begins
        the process's one yield; ``OwnerSlots.end_yield`` is called by the turn)."""
        ctx = self.ctx
        slots = ctx.owner_slots
        if not slots.holds_every_place(owner, ctx.settings.worker_concurrency) or not slots.begin_yield(self.name):
            return False
        try:
            waiting = another_owner_waiting(ctx.db, ctx.model, owner)
        except Exception as exc:
            if ctx.gate.report(exc) is None:
                slots.end_yield(self.name, owner, gave_back=False)
                raise
            waiting = False  # the database is down: look again next time
        if not waiting:
            slots.end_yield(self.name, owner, gave_back=False)
        return waiting

    def _job_stopping(self) -> bool:
        try:
            with self.ctx.db.connect() as conn:
                status = conn.execute(select(Job.status).where(Job.id == self.job_id)).scalar_one_or_none()
        except Exception as exc:
            if self.ctx.gate.report(exc) is None:
                raise
            return False  # the database is down: look again next time
        return status is None or JobStatus(status) in STOPPING

    def _abort_all(self) -> None:
        handles, self._handles = list(self._handles.values()), {}
        if handles:
            host = self.ctx.host()
            for handle in handles:
                host.abort(handle)

    # ---- endings ------------------------------------------------------------------------

    def _release(self, status: ShardStatus, *, failed_attempt: bool = False) -> ShardOutcome:
        """Release the lease with the shard's final status, then finalise the job if this
        was its last shard (each step safe to redo after an outage)."""
        ctx = self.ctx
        if not self._released:
            if not release_lease(
                ctx.db, self.job_id, self.index, self.owner, status,
                output_uri=self._parts, failed_attempt=failed_attempt,
            ):  # fmt: skip
                return self._outcome(
                    "lease_lost", self._buffer.stored, "the lease expired before the shard was released"
                )
            self._released = True
        record_shard_counts(ctx.db, self.job_id, self.index)
        result = finalize_if_ready(ctx.db, ctx.store, self.job_id, heartbeat_seconds=ctx.settings.heartbeat_seconds)
        return self._outcome(status.value, self._buffer.stored, self._reason, finalized=result is not None)

    def _failed_attempt(self, exc: Exception, shard: Shard) -> ShardOutcome:
        s = self.ctx.settings
        message = f"{type(exc).__name__}: {exc}"
        failures = shard.failures + 1
        log.error("%s attempt failed (%d of %d): %s", self.name, failures, s.shard_max_attempts, message, exc_info=exc)
        try:
            self._buffer.flush()  # keep what finished
        except Exception:
            log.warning("could not store finished items of the failed attempt", exc_info=True)
        if failures < s.shard_max_attempts:
            release_lease(
                self.ctx.db, self.job_id, self.index, self.owner, ShardStatus.pending,
                error=message[:2000], failed_attempt=True,
            )  # fmt: skip
            raise RetryShard(message, failures) from exc
        self._fail_unstored(message)
        self._parts = write_shard_parts(self.ctx.db, self.ctx.job_store(self.job_id), self.job_id, self.index)
        return self._call(lambda: self._release(ShardStatus.failed, failed_attempt=True), holding=True)

    def _fail_unstored(self, message: str) -> None:
        """Out of attempts: every item not stored yet becomes a failed item; the job goes on."""
        ctx = self.ctx
        done = stored_custom_ids(ctx.db, self.job_id, self.index)
        text = f"the shard failed {ctx.settings.shard_max_attempts} times; last error: {message}"[:2000]
        records = [
            error_record(self._item_ctx, req, code="shard_failed", message=text, status_code=500)
            for req in self._requests()
            if req.custom_id not in done
        ]
        for start in range(0, len(records), 1000):
            batch = records[start : start + 1000]
            ctx.items_stored(_newly_stored(batch, record_finished_items(ctx.db, batch)))
        self._buffer.stored += len(records)
        self._reason = text


def _newly_stored(records: list[ItemRecord], new_ids: list[str]) -> list[ItemRecord]:
    """The records whose custom_id was stored now (one each: the first of any duplicates)."""
    new = set(new_ids)
    fresh = []
    for record in records:
        if record.custom_id in new:
            new.discard(record.custom_id)
            fresh.append(record)
    return fresh


def _decode(tokenizer: Any):
    def decode(token_ids: list[int]) -> str:
        text = tokenizer.decode(token_ids)
        assert isinstance(text, str)  # one sequence in, one text out
        return text

    return decode


def run_shard(ctx: WorkerContext, job_id: str, shard_index: int) -> ShardOutcome:
    """Run one shard (``RetryShard`` if this attempt failed and the shard should run again;
    ``DependencyUnavailable`` if a dependency stayed down too long: hand the shard back)."""
    object_keys.check_job_id(job_id)
    return ShardRunner(ctx, job_id, shard_index).run()
