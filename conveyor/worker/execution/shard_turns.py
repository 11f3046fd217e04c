"""A shard message as a turn: run the pending shard of the model whose owner's turn it is.

Shard messages arrive in the order they were sent, so one owner's backlog of hundreds of
shards would stand ahead of another owner's one. Instead a message is a turn to run one of
its model's pending shards (``conveyor.worker.jobs.shard_choice``: the owner with the fewest shards
running across the fleet goes first), and each worker keeps one owner to at most
``CONVEYOR_OWNER_SHARD_SLOTS`` of its shards at once (``execution/owner_slots.py``; by default one less
than its concurrency), so a place is left for another owner's shard while a backlog fills
it. A turn that only finds owners at their limit here waits, holding its message, until
another owner's shard is pending or a place frees up (its own shard runs then: the turns
still add up, one per pending shard).

Within the owner whose turn it is, a shard of a group this worker served last goes first
(``execution/shard_affinity.py``): its prefix is likely in the engine's prefix cache. That only
orders the choice; the lease is taken as for any shard, and nothing waits for a group.

A turn with no pending shard to take runs the shard its message names, as before (it may
be one whose holder died, or one already done: ``run_shard`` tells).
"""

from __future__ import annotations

import logging
import time

from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import ShardOutcome, run_shard, shard_label
from conveyor.worker.jobs.shard_choice import ShardChoice, job_owner, next_shard

log = logging.getLogger(__name__)

WAIT_POLL_SECONDS = 1.0  # how often a waiting turn looks for another owner's shard
MAX_RACES = 5  # turns lost to another worker taking the chosen shard first, then the named one runs


def run_next_shard(ctx: WorkerContext, job_id: str, shard_index: int) -> ShardOutcome:
    """Use the turn of the message naming ``job_id``/``shard_index`` (see the module)."""
    slots = ctx.owner_slots
    races = 0
    logged_wait = False
    while True:
        if ctx.state.draining:
            return run_shard(ctx, job_id, shard_index)  # hands the message back
        pick = ctx.gate.call(
            lambda: next_shard(ctx.db, ctx.model, full=slots.full(), prefer=ctx.affinity.recent()),
            what="choosing the next shard",
            patience=ctx.settings.dependency_retry_seconds,
            give_up=lambda: ctx.state.draining,
        )
        if pick.choice is None and pick.waiting_owners:  # every owner waiting is at its limit here
            if not logged_wait:
                log.info("shard turn %s/%d: waiting for a place or another owner's shard", job_id, shard_index)
                logged_wait = True
            time.sleep(WAIT_POLL_SECONDS)
            continue
        if pick.choice is None or races >= MAX_RACES:
            return _run(ctx, ShardChoice(job_id, shard_index, _owner_of(ctx, job_id)))
        outcome = _run(ctx, pick.choice)
        if outcome.status == "skipped":
            # Another turn took it between the choice and the lease (the named shard too: the
            # turn that took it owes its own shard a run, so this turn still runs one): choose again.
            races += 1
            continue
        return outcome


def _run(ctx: WorkerContext, choice: ShardChoice) -> ShardOutcome:
    hit = ctx.affinity.serving(choice.group_key)
    ctx.owner_slots.take(choice.owner)
    outcome: ShardOutcome | None = None
    try:
        outcome = run_shard(ctx, choice.job_id, choice.shard_index)
    finally:
        ctx.owner_slots.release(choice.owner)
        gave_back = outcome is not None and outcome.yielded
        ctx.owner_slots.end_yield(shard_label(choice.job_id, choice.shard_index), choice.owner, gave_back)
    if outcome.status != "skipped":
        ctx.affinity.ran(hit)
    return outcome


def _owner_of(ctx: WorkerContext, job_id: str) -> str:
    try:
        return job_owner(ctx.db, job_id)
    except Exception as exc:
        if ctx.gate.report(exc) is None:
            raise
        return ""  # the database is down: run_shard waits for it; the count is only this process's
