"""Shard leases: a compare-and-set, so two workers can never both hold a shard."""

from __future__ import annotations

import threading

import pytest

from worker.store.db import Job, Shard, ShardStatus, create_db_engine, make_sessionmaker
from worker.store.leases import (
    LeaseLost,
    acquire_lease,
    ensure_lease,
    heartbeat_lease,
    new_lease_owner,
    release_lease,
)


def _make_shard(engine) -> None:
    with make_sessionmaker(engine).begin() as session:
        session.add(Job(id="batch_1", model="m", shard_size=10))
        session.add(Shard(job_id="batch_1", shard_index=0, first_line=1, last_line=10, num_items=10))


def _shard(engine) -> Shard:
    with make_sessionmaker(engine)() as session:
        return session.get(Shard, ("batch_1", 0))


def test_concurrent_contenders_exactly_one_wins(db_engine, db_url) -> None:
    _make_shard(db_engine)
    contenders = 8
    engines = [create_db_engine(db_url) for _ in range(contenders)]  # separate pools, like processes
    barrier = threading.Barrier(contenders)
    wins: list[str] = []

    def contend(engine) -> None:
        owner = new_lease_owner()
        barrier.wait()
        if acquire_lease(engine, "batch_1", 0, owner, ttl=30):
            wins.append(owner)

    threads = [threading.Thread(target=contend, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in engines:
        e.dispose()
    assert len(wins) == 1
    shard = _shard(db_engine)
    assert shard.lease_owner == wins[0] and shard.status is ShardStatus.running and shard.attempts == 1


def test_a_live_lease_blocks_and_an_expired_one_is_taken_over(db_engine) -> None:
    _make_shard(db_engine)
    a, b = new_lease_owner(), new_lease_owner()
    assert a != b
    assert acquire_lease(db_engine, "batch_1", 0, a, ttl=10, at=1000.0)
    assert not acquire_lease(db_engine, "batch_1", 0, b, ttl=10, at=1005.0)
    assert heartbeat_lease(db_engine, "batch_1", 0, a, ttl=10, at=1008.0)  # now expires at 1018
    assert not acquire_lease(db_engine, "batch_1", 0, b, ttl=10, at=1015.0)
    # a dies; its lease runs out and b takes over
    assert acquire_lease(db_engine, "batch_1", 0, b, ttl=10, at=1019.0)
    assert _shard(db_engine).attempts == 2
    assert not heartbeat_lease(db_engine, "batch_1", 0, a, ttl=10, at=1020.0)
    with pytest.raises(LeaseLost, match="no longer held"):
        ensure_lease(db_engine, "batch_1", 0, a, ttl=10)
    assert not release_lease(db_engine, "batch_1", 0, a, ShardStatus.completed)
    assert release_lease(db_engine, "batch_1", 0, b, ShardStatus.completed, output_uri="s3://x/part", at=1021.0)
    shard = _shard(db_engine)
    assert shard.status is ShardStatus.completed and shard.lease_owner is None
    assert shard.output_uri == "s3://x/part" and shard.finished_at == 1021.0
    # a finished shard cannot be leased again, even by a redelivered task
    assert not acquire_lease(db_engine, "batch_1", 0, a, ttl=10, at=5000.0)


def test_release_to_pending_lets_another_attempt_start(db_engine) -> None:
    _make_shard(db_engine)
    a, b = new_lease_owner(), new_lease_owner()
    assert acquire_lease(db_engine, "batch_1", 0, a, ttl=10)
    assert release_lease(db_engine, "batch_1", 0, a, ShardStatus.pending)
    assert _shard(db_engine).finished_at is None
    assert acquire_lease(db_engine, "batch_1", 0, b, ttl=10)
    assert _shard(db_engine).attempts == 2


def test_missing_shard_is_never_acquired(db_engine) -> None:
    assert not acquire_lease(db_engine, "nope", 0, new_lease_owner(), ttl=10)
