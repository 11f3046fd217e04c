"""Worker deaths are not their items' fault: the worker holding one shard is SIGKILLed three
times, each time after the shard made some progress, and the job still completes with every
item exactly once and none failed (a death used to count as a failed attempt: the third
made every unstored item of the shard a ``shard_failed`` error)."""

from __future__ import annotations

from sqlalchemy import func, select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Item, Shard, ShardStatus
from tests.worker.helpers import SLOW_ENGINE, assert_each_request_once, jsonl, openai_lines, wait_for

KILLS = 3


def _shard_state(db, job_id: str, index: int) -> tuple[ShardStatus, str | None, int]:
    """(status, lease owner, items stored) of one shard."""
    with db.connect() as conn:
        status, owner = conn.execute(
            select(Shard.status, Shard.lease_owner).where(Shard.job_id == job_id, Shard.shard_index == index)
        ).one()
        stored = conn.execute(
            select(func.count()).select_from(Item).where(Item.job_id == job_id, Item.shard_index == index)
        ).scalar_one()
    return ShardStatus(status), owner, stored


def test_killing_the_worker_of_one_shard_three_times_fails_no_item(pg_redis_s3_stack, spawn_worker) -> None:
    stack = pg_redis_s3_stack.with_values(engine_args=SLOW_ENGINE)
    workers = [spawn_worker(stack, concurrency=2), spawn_worker(stack, concurrency=2)]
    for w in workers:
        w.wait_ready()
    client = Client(stack.settings)
    db = create_db_engine(stack.settings.database)
    n, size, target = 24, 12, 0
    job = client.submit(jsonl(openai_lines(n, max_tokens=128, ignore_eos=True)), stack.model, shard_size=size)
    job_id = job["id"]

    stored_at_kill = 0
    for kill in range(KILLS):
        # a live holder that stored at least one more item of the shard since the last kill (the
        # lease still names the killed worker until another reclaims it, so the owner must be live)
        def progressed(after: int = stored_at_kill) -> tuple[int, int] | None:
            status, owner, stored = _shard_state(db, job_id, target)
            live = {w.pid for w in workers}
            if status is ShardStatus.running and owner is not None and stored > after:
                pid = int(owner.split(":")[1])
                return (pid, stored) if pid in live else None
            return None

        pid, stored = wait_for(progressed, 90, f"progress of shard {target} before kill {kill + 1}")
        assert stored < size, "the shard finished before it was killed; make it slower"
        victim = next(w for w in workers if w.pid == pid)
        victim.kill9()
        workers.remove(victim)
        # the victim may have stored more between the read and the kill; count from what it left
        stored_at_kill = _shard_state(db, job_id, target)[2]
        replacement = spawn_worker(stack, concurrency=2)
        workers.append(replacement)

    job = client.wait(job_id, timeout=120, poll=0.2)
    assert_each_request_once(client, db, job, n)
    with db.connect() as conn:
        deaths, failures, attempts = conn.execute(
            select(Shard.deaths, Shard.failures, Shard.attempts).where(
                Shard.job_id == job_id, Shard.shard_index == target
            )
        ).one()
    assert deaths == KILLS and failures == 0 and attempts == KILLS + 1
    db.dispose()
    client.close()
