"""Which pending shard a shard message runs (``conveyor.worker.jobs.shard_choice``), on SQLite and
PostgreSQL: the owner with the fewest shards running goes first, an owner at its limit in
this worker is skipped, and priority and deadline order only one owner's shards."""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from conveyor.worker.jobs.shard_choice import ShardChoice, job_owner, next_shard
from conveyor.worker.store.models import Job, JobStatus, Shard, ShardStatus


def add_job(db, job_id: str, owner: str | None, shards: int, *, model: str = "m", **job) -> None:
    with Session(db) as session, session.begin():
        session.add(Job(id=job_id, model=model, shard_size=1, owner=owner, status=JobStatus.in_progress, **job))
        for i in range(shards):
            session.add(Shard(job_id=job_id, shard_index=i, first_line=i + 1, last_line=i + 1, num_items=1))


def set_running(db, job_id: str, index: int) -> None:
    with Session(db) as session, session.begin():
        shard = session.get(Shard, (job_id, index))
        assert shard is not None
        shard.status, shard.lease_owner, shard.lease_expires_at = ShardStatus.running, "w", time.time() + 60


def test_the_owner_with_fewest_running_goes_first_whatever_came_first(db_engine) -> None:
    t = time.time()
    add_job(db_engine, "batch_a", "key_a", 5, created_at=t - 100, expires_at=t + 3600)  # first, and due sooner
    add_job(db_engine, "batch_b", "key_b", 1, created_at=t, expires_at=t + 86_400)
    add_job(db_engine, "batch_x", "key_x", 1, model="other", created_at=t - 200)  # another model's
    # Nobody runs anything: the owner whose oldest waiting job is oldest (A).
    assert next_shard(db_engine, "m").choice == ShardChoice("batch_a", 0, "key_a")
    set_running(db_engine, "batch_a", 0)
    pick = next_shard(db_engine, "m")
    assert pick.choice == ShardChoice("batch_b", 0, "key_b") and pick.waiting_owners == 2
    set_running(db_engine, "batch_b", 0)
    assert next_shard(db_engine, "m").choice == ShardChoice("batch_a", 1, "key_a")  # B has none left


def test_an_owner_at_its_limit_here_is_skipped_and_the_turn_may_wait(db_engine) -> None:
    add_job(db_engine, "batch_a", "key_a", 3)
    add_job(db_engine, "batch_c", None, 1)  # the CLI's jobs: owner ""
    assert next_shard(db_engine, "m", full={"key_a"}).choice == ShardChoice("batch_c", 0, "")
    pick = next_shard(db_engine, "m", full={"key_a", ""})
    assert pick.choice is None and pick.waiting_owners == 2
    assert job_owner(db_engine, "batch_c") == "" and job_owner(db_engine, "batch_a") == "key_a"


def test_a_lone_owner_is_not_held_to_its_limit_until_another_owner_has_work(db_engine) -> None:
    add_job(db_engine, "batch_a", "key_a", 3)
    set_running(db_engine, "batch_a", 0)
    # Only A has work for the model: the place its limit keeps for another owner would stay empty.
    assert next_shard(db_engine, "m", full={"key_a"}).choice == ShardChoice("batch_a", 1, "key_a")
    add_job(db_engine, "batch_b", "key_b", 1)
    set_running(db_engine, "batch_b", 0)  # B now has work running (none waiting): A's limit holds again
    pick = next_shard(db_engine, "m", full={"key_a"})
    assert pick.choice is None and pick.waiting_owners == 1


def test_within_one_owner_priority_then_deadline_then_age(db_engine) -> None:
    t = time.time()
    add_job(db_engine, "batch_late", "k", 1, created_at=t - 50, expires_at=t + 86_400)
    add_job(db_engine, "batch_soon", "k", 1, created_at=t, expires_at=t + 3600)
    add_job(db_engine, "batch_urgent", "k", 1, created_at=t, expires_at=t + 86_400 * 7, priority=-1)
    order = []
    for _ in range(3):
        choice = next_shard(db_engine, "m").choice
        assert choice is not None
        order.append(choice.job_id)
        set_running(db_engine, choice.job_id, choice.shard_index)
    assert order == ["batch_urgent", "batch_soon", "batch_late"]
    assert next_shard(db_engine, "m").choice is None


def test_a_shard_of_a_group_served_last_goes_first_within_the_owner_and_nothing_waits_for_it(db_engine) -> None:
    t = time.time()
    add_job(db_engine, "batch_old", "k", 2, created_at=t - 100, expires_at=t + 3600)
    add_job(db_engine, "batch_new", "k", 2, created_at=t, expires_at=t + 3600)
    with Session(db_engine) as session, session.begin():
        for job_id, index, key in [("batch_old", 0, "g1"), ("batch_old", 1, "g2"), ("batch_new", 1, "g9")]:
            shard = session.get(Shard, (job_id, index))
            assert shard is not None
            shard.group_key = key
    # With nothing preferred: the older job first, as always.
    assert next_shard(db_engine, "m").choice == ShardChoice("batch_old", 0, "k", "g1")
    # A worker that just served g9 takes g9's shard from the newer job before the older job's.
    assert next_shard(db_engine, "m", prefer=["g9"]).choice == ShardChoice("batch_new", 1, "k", "g9")
    assert next_shard(db_engine, "m", prefer=["g2", "g7"]).choice == ShardChoice("batch_old", 1, "k", "g2")
    # A preferred group with nothing pending: the next shard in the usual order, at once.
    set_running(db_engine, "batch_new", 1)
    assert next_shard(db_engine, "m", prefer=["g9"]).choice == ShardChoice("batch_old", 0, "k", "g1")
    # Priority still comes before affinity.
    add_job(db_engine, "batch_urgent", "k", 1, created_at=t, expires_at=t + 3600, priority=-1)
    assert next_shard(db_engine, "m", prefer=["g2"]).choice == ShardChoice("batch_urgent", 0, "k")
