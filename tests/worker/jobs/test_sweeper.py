"""The sweeper: work of dead workers is handed back exactly once, whoever sweeps."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select, update

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.jobs.sweeper import Sweeper
from conveyor.worker.store.leases import acquire_lease
from conveyor.worker.store.models import Job, JobStatus, Shard, ShardStatus
from tests.worker.helpers import jsonl, openai_lines


class _Recorder:
    def __init__(self, depth: int | None = 0) -> None:
        self.shards: list[tuple[str, int]] = []
        self.finals: list[tuple[str, bool]] = []
        self.depth = depth

    def sweeper(self, ctx: WorkerContext) -> Sweeper:
        return Sweeper(
            ctx.db,
            ctx.model,
            ctx.settings,
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
        row = conn.execute(
            select(Shard.status, Shard.lease_owner).where(Shard.job_id == job["id"], Shard.shard_index == 0)
        ).one()
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
    _client, ctx, job = setup
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


def test_an_expired_lease_counts_a_death_and_charges_the_item_running_alone(setup) -> None:
    from conveyor.worker.store.crashes import crash_counts, set_solo_item

    _client, ctx, job = setup
    assert acquire_lease(ctx.db, job["id"], 0, "dead", ttl=1, at=time.time() - 60)
    set_solo_item(ctx.db, job["id"], 0, "dead", "req-1")
    assert _Recorder(depth=3).sweeper(ctx).sweep_once().expired == [(job["id"], 0)]
    assert crash_counts(ctx.db, job["id"], 0) == {"req-1": 1}
    with ctx.db.connect() as conn:
        deaths, failures, solo = conn.execute(
            select(Shard.deaths, Shard.failures, Shard.solo_item).where(
                Shard.job_id == job["id"], Shard.shard_index == 0
            )
        ).one()
    assert (deaths, failures, solo) == (1, 0, None)


def test_after_a_database_outage_leases_get_a_lease_period_to_be_renewed(setup, tmp_path) -> None:
    """A sweeper that could not reach the database does not take its first look back as
    proof that every holder died: holders cut off by the same outage renew first."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError

    _client, ctx, job = setup
    sweeper = _Recorder(depth=3).sweeper(ctx)
    sweeper.db = create_engine(f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}")  # unreachable
    with pytest.raises(OperationalError):
        sweeper.sweep_once()
    sweeper.db = ctx.db  # back
    assert acquire_lease(ctx.db, job["id"], 0, "alive-but-cut-off", ttl=1, at=time.time() - 60)
    assert sweeper.sweep_once().expired == []  # within a lease period of the recovery
    sweeper._judge_leases_from = 0.0  # a lease period later
    assert sweeper.sweep_once().expired == [(job["id"], 0)]


def test_after_a_broker_reconnect_pending_shards_are_enqueued_at_once(setup) -> None:
    _client, ctx, job = setup
    rec = _Recorder(depth=0)
    sweeper = rec.sweeper(ctx)
    assert sweeper.sweep_once().lost == []  # just enqueued: their messages get a lease period
    sweeper.after_broker_reconnect()
    rec.depth = None  # not connected yet: try again next sweep
    assert sweeper.sweep_once().lost == []
    rec.depth = 0
    assert sorted(sweeper.sweep_once().lost) == [(job["id"], i) for i in range(3)]
    assert sweeper.sweep_once().lost == []  # once
