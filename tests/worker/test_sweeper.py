"""The sweeper: work of dead workers is handed back exactly once, whoever sweeps."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select, update

from tests.worker.helpers import jsonl, openai_lines
from worker.client import Client
from worker.context import WorkerContext
from worker.store.db import Job, JobStatus, Shard, ShardStatus
from worker.store.leases import acquire_lease
from worker.sweeper import Sweeper


class _Recorder:
    def __init__(self, depth: int | None = 0) -> None:
        self.shards: list[tuple[str, int]] = []
        self.finals: list[tuple[str, bool]] = []
        self.depth = depth

    def sweeper(self, ctx: WorkerContext) -> Sweeper:
        return Sweeper(
            ctx,
            enqueue_shard=lambda j, i: self.shards.append((j, i)),
            enqueue_finalize=lambda j, redo: self.finals.append((j, redo)),
            queue_depth=lambda: self.depth,
        )


@pytest.fixture
def setup(embedded_stack):
    client = Client(embedded_stack.settings)
    job = client.submit(jsonl(openai_lines(6)), embedded_stack.model, shard_size=2, enqueue=False)
    ctx = WorkerContext.create(embedded_stack.settings)
    yield client, ctx, job
    ctx.close()
    client.close()


def _age_pending(ctx, job_id: str, seconds: float) -> None:
    with ctx.db.begin() as conn:
        conn.execute(update(Shard).where(Shard.job_id == job_id).values(heartbeat_at=time.time() - seconds))


def test_expired_leases_are_handed_back_once(setup) -> None:
    _client, ctx, job = setup
    assert acquire_lease(ctx.db, job["id"], 0, "dead", ttl=1, at=time.time() - 60)
    assert acquire_lease(ctx.db, job["id"], 1, "alive", ttl=60)
    rec = _Recorder(depth=3)  # a busy queue: lost-message recovery stays off
    a, b = rec.sweeper(ctx), rec.sweeper(ctx)
    assert a.sweep_once().expired == [(job["id"], 0)]
    assert b.sweep_once().expired == []
    assert rec.shards == [(job["id"], 0)]
    with ctx.db.connect() as conn:
        row = conn.execute(select(Shard.status, Shard.lease_owner).where(Shard.job_id == job["id"], Shard.shard_index == 0)).one()
    assert row.status is ShardStatus.pending and row.lease_owner is None


def test_pending_shards_are_re_enqueued_only_when_the_queue_is_empty(setup) -> None:
    _client, ctx, job = setup
    fresh = _Recorder(depth=0)
    assert fresh.sweeper(ctx).sweep_once().lost == []  # just enqueued: give their messages time
    _age_pending(ctx, job["id"], 3600)
    for depth in (None, 5):
        busy = _Recorder(depth=depth)
        assert busy.sweeper(ctx).sweep_once().lost == []
    empty = _Recorder(depth=0)
    assert sorted(empty.sweeper(ctx).sweep_once().lost) == [(job["id"], i) for i in range(3)]
    assert empty.sweeper(ctx).sweep_once().lost == []  # stamped: not again for a lease period


def test_other_models_jobs_are_not_touched(setup) -> None:
    _client, ctx, job = setup
    with ctx.db.begin() as conn:
        conn.execute(update(Job).where(Job.id == job["id"]).values(model="Other/model"))
    _age_pending(ctx, job["id"], 3600)
    assert acquire_lease(ctx.db, job["id"], 0, "dead", ttl=1, at=time.time() - 60)
    report = _Recorder(depth=0).sweeper(ctx).sweep_once()
    assert report.expired == [] and report.lost == []


def test_stalled_finalisation_is_redone_and_a_missed_one_is_started(setup, embedded_stack) -> None:
    client, ctx, job = setup
    with ctx.db.begin() as conn:
        conn.execute(update(Shard).where(Shard.job_id == job["id"]).values(status=ShardStatus.completed))
        conn.execute(update(Job).where(Job.id == job["id"]).values(updated_at=time.time() - 3600))
    rec = _Recorder(depth=3)
    assert rec.sweeper(ctx).sweep_once().finalize == [job["id"]]
    assert rec.sweeper(ctx).sweep_once().finalize == []  # claimed by the first sweep
    with ctx.db.begin() as conn:
        conn.execute(
            update(Job)
            .where(Job.id == job["id"])
            .values(status=JobStatus.finalizing, finalizing_at=time.time() - 3600, updated_at=time.time() - 3600)
        )
    assert rec.sweeper(ctx).sweep_once().refinalize == [job["id"]]
    assert rec.finals == [(job["id"], False), (job["id"], True)]
