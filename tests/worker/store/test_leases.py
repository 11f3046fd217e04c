"""Shard leases: a compare-and-set, so two workers can never both hold a shard."""

from __future__ import annotations

import threading

from conveyor.worker.store.database import create_db_engine, make_sessionmaker
from conveyor.worker.store.leases import (
    acquire_lease,
    heartbeat_lease,
    new_lease_owner,
    release_lease,
)
from conveyor.worker.store.models import Job, Shard, ShardStatus


def _make_shard(engine) -> None:
    with make_sessionmaker(engine).begin() as session:
        session.add(Job(id="batch_1", model="m", shard_size=10))
        session.add(Shard(job_id="batch_1", shard_index=0, first_line=1, last_line=10, num_items=10))


def _shard(engine) -> Shard:
    with make_sessionmaker(engine)() as session:
        shard = session.get(Shard, ("batch_1", 0))
        assert shard is not None
        return shard


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


def test_a_holder_takes_its_own_lease_again_without_counting_an_attempt(db_engine) -> None:
    """After waiting out an outage a task takes its lease again, even an expired one."""
    _make_shard(db_engine)
    a, b = new_lease_owner(), new_lease_owner()
    assert acquire_lease(db_engine, "batch_1", 0, a, ttl=10, at=1000.0)
    assert acquire_lease(db_engine, "batch_1", 0, a, ttl=10, at=1005.0)
    assert acquire_lease(db_engine, "batch_1", 0, a, ttl=10, at=1100.0)  # expired, but still its own
    shard = _shard(db_engine)
    assert shard.attempts == 1 and shard.deaths == 0 and shard.lease_expires_at == 1110.0
    assert not acquire_lease(db_engine, "batch_1", 0, b, ttl=10, at=1105.0)


def test_taking_over_from_a_dead_holder_counts_a_death_not_a_failure(db_engine) -> None:
    _make_shard(db_engine)
    a, b = new_lease_owner(), new_lease_owner()
    assert acquire_lease(db_engine, "batch_1", 0, a, ttl=10, at=1000.0)
    assert acquire_lease(db_engine, "batch_1", 0, b, ttl=10, at=1011.0)
    shard = _shard(db_engine)
    assert (shard.attempts, shard.deaths, shard.failures) == (2, 1, 0)
    assert release_lease(db_engine, "batch_1", 0, b, ShardStatus.pending, error="boom", failed_attempt=True)
    shard = _shard(db_engine)
    assert (shard.attempts, shard.deaths, shard.failures) == (2, 1, 1)


def test_only_an_unstored_item_running_alone_is_charged_with_a_death(db_engine) -> None:
    from conveyor.worker.store.crashes import crash_counts, set_solo_item
    from conveyor.worker.store.items import ItemRecord, record_finished_items
    from conveyor.worker.store.models import ItemStatus

    _make_shard(db_engine)
    owners = [new_lease_owner() for _ in range(5)]
    t = 1000.0
    assert acquire_lease(db_engine, "batch_1", 0, owners[0], ttl=10, at=t)  # a group in flight
    for i, owner in enumerate(owners[1:], start=1):
        if i in (1, 2):
            set_solo_item(db_engine, "batch_1", 0, owners[i - 1], "req-7")  # req-7 alone, twice
        if i == 3:
            set_solo_item(db_engine, "batch_1", 0, owners[i - 1], "req-8")  # req-8 alone, then stored
            record_finished_items(db_engine, [ItemRecord("batch_1", "req-8", 0, 8, ItemStatus.succeeded)])
        t += 20
        assert acquire_lease(db_engine, "batch_1", 0, owner, ttl=10, at=t)  # the holder died
    assert crash_counts(db_engine, "batch_1", 0) == {"req-7": 2}
    shard = _shard(db_engine)
    assert shard.deaths == 4 and shard.solo_item is None
    set_solo_item(db_engine, "batch_1", 0, owners[0], "req-9")  # not the holder: ignored
    assert _shard(db_engine).solo_item is None
