"""Workers built for scale-to-zero, as real processes: SIGTERM drains (the worker exits 0 within
``--drain-timeout`` and its shard is resumed by another worker at once, not after a lease
period, with every item exactly once), ``--exit-when-idle`` ends an idle worker with exit
code 0 and nothing lost, and ``/readyz`` answers 200 only once the model is loaded."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from sqlalchemy import func, select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Item, Shard, ShardStatus
from tests.worker.helpers import SLOW_ENGINE, assert_each_request_once, jsonl, openai_lines, wait_for
from tests.worker.services import free_port

# SLOW_ENGINE: one request at a time, so a shard of 48 x 256 tokens takes some 10 s on the tiny model.
DRAIN_TIMEOUT = 4.0
LEASE_SECONDS = 60.0  # a takeover "at once" is far quicker than waiting out a lease


def _shard(db, job_id: str) -> tuple[ShardStatus, str | None, int, int]:
    with db.connect() as conn:
        row = conn.execute(
            select(Shard.status, Shard.lease_owner, Shard.deaths, Shard.failures).where(
                Shard.job_id == job_id, Shard.shard_index == 0
            )
        ).one()
    return ShardStatus(row.status), row.lease_owner, row.deaths, row.failures


def _stored_by_worker(db, job_id: str) -> dict[str, int]:
    with db.connect() as conn:
        rows = conn.execute(
            select(Item.worker_id, func.count()).where(Item.job_id == job_id).group_by(Item.worker_id)
        ).all()
    return {str(worker): count for worker, count in rows}


def test_sigterm_mid_shard_drains_and_another_worker_resumes_the_shard_at_once(pg_redis_s3_stack, spawn_worker) -> None:
    stack = pg_redis_s3_stack.with_values(engine_args=SLOW_ENGINE, lease_seconds=LEASE_SECONDS, heartbeat_seconds=1.0)
    workers = [spawn_worker(stack, args=("--drain-timeout", str(DRAIN_TIMEOUT))) for _ in range(2)]
    for w in workers:
        w.wait_ready()
    client = Client(stack.settings)
    db = create_db_engine(stack.settings.database)
    n = 48
    job_id = client.submit(jsonl(openai_lines(n, max_tokens=256, ignore_eos=True)), stack.model, shard_size=n)["id"]

    def holder_with_progress() -> int | None:
        status, owner, _, _ = _shard(db, job_id)
        stored = sum(_stored_by_worker(db, job_id).values())
        if status is ShardStatus.running and owner is not None and stored >= 1:
            return int(owner.split(":")[1])
        return None

    holder = wait_for(holder_with_progress, 90, "a worker to hold the shard and store an item")
    first = next(w for w in workers if w.pid == holder)
    second = next(w for w in workers if w.pid != holder)
    assert _shard(db, job_id)[0] is ShardStatus.running, "the shard finished before the drain; make it slower"

    signalled = time.monotonic()
    first.terminate()
    first.proc.wait(DRAIN_TIMEOUT + 20)
    exited = time.monotonic()
    assert first.proc.returncode == 0, first.log()[-3000:]
    assert exited - signalled <= DRAIN_TIMEOUT + 5, f"drained in {exited - signalled:.1f} s\n{first.log()[-3000:]}"
    assert "handed back" in first.log()

    def second_holds_it() -> bool:
        status, owner, _, _ = _shard(db, job_id)
        return status is not ShardStatus.pending and owner is not None and f":{second.pid}:" in f"{owner}:"

    def done() -> bool:
        return _shard(db, job_id)[0] is ShardStatus.completed

    wait_for(lambda: second_holds_it() or done(), 15, "the second worker to take the shard over")
    taken_over = time.monotonic()
    assert taken_over - exited < LEASE_SECONDS / 4, "the shard waited for its lease to expire"

    job = client.wait(job_id, timeout=180, poll=0.2)
    assert_each_request_once(client, db, job, n)
    status, _, deaths, failures = _shard(db, job_id)
    assert (status, deaths, failures) == (ShardStatus.completed, 0, 0)  # a drain is neither a death nor a failure
    by_worker = _stored_by_worker(db, job_id)
    assert len(by_worker) == 2 and all(count > 0 for count in by_worker.values()), by_worker
    db.dispose()
    client.close()


def test_exit_when_idle_exits_zero_after_the_idle_time_with_nothing_lost(embedded_stack, spawn_worker) -> None:
    idle = 3.0
    worker = spawn_worker(embedded_stack, args=("--exit-when-idle", str(idle)))
    worker.wait_ready()
    client = Client(embedded_stack.settings)
    db = create_db_engine(embedded_stack.settings.database)
    n = 8
    job_id = client.submit(jsonl(openai_lines(n, max_tokens=8)), embedded_stack.model, shard_size=4)["id"]
    job = client.wait(job_id, timeout=120, poll=0.1)
    finished = time.monotonic()
    worker.proc.wait(60)
    exited = time.monotonic()
    assert worker.proc.returncode == 0, worker.log()[-3000:]
    assert exited - finished >= idle - 0.5, "the worker exited before it had been idle long enough"
    assert f"no task for {idle:.0f} s" in worker.log()
    assert_each_request_once(client, db, job, n)
    db.dispose()
    client.close()


def _probe(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_readiness_flips_only_after_the_model_is_loaded(embedded_stack, spawn_worker) -> None:
    port = free_port()
    worker = spawn_worker(embedded_stack, args=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"))
    seen: list[tuple[int, dict]] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert worker.proc.poll() is None, worker.log()[-3000:]
        try:
            live = _probe(port, "/healthz")
            ready = _probe(port, "/readyz")
        except OSError:  # not listening yet
            time.sleep(0.02)
            continue
        assert live[0] == 200, live
        seen.append(ready)
        if ready[0] == 200:
            break
        time.sleep(0.02)
    assert seen and seen[-1][0] == 200, seen[-3:]
    assert seen[-1][1]["model_loaded"] is True and seen[-1][1]["phase"] == "ready"
    # Answers came before the model was loaded, and said not ready then.
    assert seen[0][0] == 503 and seen[0][1]["model_loaded"] is False, seen[0]
    assert all(status == 503 for status, _ in seen[:-1])
    worker.wait_ready()  # Celery's own "ready." line
    assert _probe(port, "/readyz")[0] == 200
    # A path the server does not serve is a 404, and /metrics is still Prometheus text.
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5)
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
    else:
        raise AssertionError("/nope answered 200")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert b"conveyor_items_total" in resp.read()
