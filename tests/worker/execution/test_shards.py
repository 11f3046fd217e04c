"""Shard execution without a broker: redelivery, leases, partial progress, retries."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

import pytest
from sqlalchemy import select, update

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.engine_host import RequestHandle
from conveyor.worker.execution.shard_runner import RetryShard, ShardOutcome, run_shard
from conveyor.worker.store.items import ItemRecord, record_finished_items
from conveyor.worker.store.leases import acquire_lease
from conveyor.worker.store.models import ItemStatus, Job, Shard, ShardStatus
from tests.worker.helpers import jsonl, openai_lines, parse_lines, wait_for


@pytest.fixture
def queued(embedded_stack):
    """(client, ctx, job) for an 8-item job in 2 shards, nothing enqueued."""
    client = Client(embedded_stack.settings)
    job = client.submit(jsonl(openai_lines(8)), embedded_stack.model, shard_size=4, enqueue=False)
    ctx = WorkerContext.create(embedded_stack.settings)
    yield client, ctx, job
    ctx.close()
    client.close()


def test_a_redelivered_shard_is_skipped(queued) -> None:
    client, ctx, job = queued
    first = run_shard(ctx, job["id"], 0)
    assert first.status == "completed" and first.items == 4 and not first.finalized
    again = run_shard(ctx, job["id"], 0)
    assert again.status == "skipped" and "already completed" in again.reason
    last = run_shard(ctx, job["id"], 1)
    assert last.finalized and client.status(job["id"])["status"] == "completed"
    assert len(list(client.results(job["id"]))) == 8


def test_items_already_stored_are_not_run_again(queued) -> None:
    client, ctx, job = queued
    marker = {"object": "text_completion", "choices": [{"text": "from the first attempt"}]}
    record_finished_items(
        ctx.db,
        [ItemRecord(job["id"], f"req-{i}", 0, i + 1, ItemStatus.succeeded, response=marker) for i in (0, 2)],
    )
    outcome = run_shard(ctx, job["id"], 0)
    assert outcome.status == "completed" and outcome.items == 2
    run_shard(ctx, job["id"], 1)
    results = parse_lines(client.results(job["id"]))
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(8)]
    assert [r["response"]["body"] == marker for r in results[:4]] == [True, False, True, False]


def test_a_live_lease_elsewhere_means_skip_and_an_expired_one_is_taken_over(queued) -> None:
    _client, ctx, job = queued
    assert acquire_lease(ctx.db, job["id"], 0, "other-worker", ttl=60)
    skipped = run_shard(ctx, job["id"], 0)
    assert skipped.status == "skipped" and "another worker" in skipped.reason
    assert acquire_lease(ctx.db, job["id"], 1, "dead-worker", ttl=1, at=time.time() - 100)
    taken = run_shard(ctx, job["id"], 1)
    assert taken.status == "completed" and taken.items == 4
    with ctx.db.connect() as conn:
        attempts = conn.execute(
            select(Shard.attempts).where(Shard.job_id == job["id"], Shard.shard_index == 1)
        ).scalar()
    assert attempts == 2


class _StuckHost:
    """A host whose requests never finish (or whose submit fails)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.aborted: list[RequestHandle] = []
        self.pid, self.alive, self.tokenizer = os.getpid(), True, None

    def submit(self, prompt, params, *, priority=0, deadline=None, tag=None, on_done=None, owner=""):
        if self.fail:
            raise RuntimeError("engine exploded")
        return RequestHandle(f"r{id(tag)}", Future(), tag)

    def abort(self, handle):
        self.aborted.append(handle)

    def close(self):
        pass


def test_failed_attempts_are_retried_then_the_items_fail_and_the_job_goes_on(embedded_stack) -> None:
    stack = embedded_stack.with_values(shard_max_attempts=2)
    client = Client(stack.settings)
    job = client.submit(jsonl(openai_lines(4)), stack.model, shard_size=4, enqueue=False)
    ctx = WorkerContext.create(stack.settings, host_factory=lambda: _StuckHost(fail=True))
    with pytest.raises(RetryShard, match="engine exploded"):
        run_shard(ctx, job["id"], 0)
    with ctx.db.connect() as conn:
        status, error = conn.execute(select(Shard.status, Shard.error).where(Shard.job_id == job["id"])).one()
    assert status is ShardStatus.pending and error is not None and "engine exploded" in error
    outcome = run_shard(ctx, job["id"], 0)
    assert outcome.status == "failed" and outcome.finalized
    final = client.status(job["id"])
    assert final["status"] == "completed" and final["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    errors = parse_lines(client.results(job["id"], errors=True))
    failures = {(e["error"], e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errors}
    assert failures == {(None, 500, "shard_failed")}
    assert "engine exploded" in errors[0]["response"]["body"]["error"]["message"]
    ctx.close()
    client.close()


def test_a_lost_lease_stops_the_shard_and_aborts_its_items(queued) -> None:
    _client, ctx, job = queued
    host = _StuckHost()
    ctx.host_factory = lambda: host
    box: dict[str, ShardOutcome] = {}
    runner = threading.Thread(target=lambda: box.setdefault("outcome", run_shard(ctx, job["id"], 0)))
    runner.start()
    wait_for(lambda: len(host.aborted) == 0 and _owner(ctx, job["id"]), 10, "the lease")
    time.sleep(0.3)
    with ctx.db.begin() as conn:  # another worker took the shard over
        conn.execute(update(Shard).where(Shard.job_id == job["id"], Shard.shard_index == 0).values(lease_owner="thief"))
    runner.join(10)
    assert box["outcome"].status == "lease_lost" and len(host.aborted) == 4


def _owner(ctx, job_id: str):
    with ctx.db.connect() as conn:
        return conn.execute(select(Shard.lease_owner).where(Shard.job_id == job_id, Shard.shard_index == 0)).scalar()


def test_a_job_for_another_model_is_left_alone(queued, embedded_stack) -> None:
    _client, ctx, job = queued
    with ctx.db.begin() as conn:
        conn.execute(update(Job).where(Job.id == job["id"]).values(model="Other/model"))
    assert run_shard(ctx, job["id"], 0).status == "skipped"
    with ctx.db.connect() as conn:
        assert (
            conn.execute(select(Shard.status).where(Shard.job_id == job["id"], Shard.shard_index == 0)).scalar()
            is ShardStatus.pending
        )


class _RecordingHost:
    """The real engine host, recording what each submission asked for."""

    def __init__(self, host) -> None:
        self._host = host
        self.asked: list[tuple[int, float | None]] = []

    def submit(self, prompt, params, **kw):
        self.asked.append((kw["priority"], kw["deadline"]))
        return self._host.submit(prompt, params, **kw)

    def __getattr__(self, name):
        return getattr(self._host, name)


def test_every_item_carries_the_jobs_priority_and_deadline(queued) -> None:
    """The engine orders a job's items by the job's priority, then by its deadline: the
    job's ``expires_at`` (created_at + completion window)."""
    _client, ctx, job = queued
    with ctx.db.begin() as conn:
        conn.execute(update(Job).where(Job.id == job["id"]).values(priority=3))
    with ctx.db.connect() as conn:
        expires_at = conn.execute(select(Job.expires_at).where(Job.id == job["id"])).scalar()
    real = ctx.host_factory
    host = _RecordingHost(real())
    ctx.host_factory = lambda: host
    assert run_shard(ctx, job["id"], 0).status == "completed"
    assert expires_at is not None and host.asked == [(3, expires_at)] * 4


def test_on_one_engine_host_the_job_due_sooner_is_served_first(tiny_model) -> None:
    """Two jobs' items on one engine (one sequence at a time, the worker's default
    ``priority`` policy): equal priorities, so the items due sooner all finish first, though
    they were submitted last; a more important job still goes before both."""
    from conveyor.engine import EngineConfig, SamplingParams
    from conveyor.worker.execution.engine_host import EngineHost

    # Inputs prepared on the loop thread (no input stage): all seven reach the feed together.
    config = EngineConfig(tiny_model, device="cpu", max_num_seqs=1, scheduling_policy="priority")
    host = EngineHost.from_config(config, input_threads=0)
    done: list[str] = []
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    now = time.time()
    try:
        with host._cv:  # the loop takes all of them in one go: the order is the scheduler's alone
            for i in range(3):
                host.submit(
                    "Tea", params, deadline=now + 48 * 3600, tag=f"late{i}", on_done=lambda h: done.append(h.tag)
                )
            for i in range(3):
                host.submit("Tea", params, deadline=now + 3600, tag=f"soon{i}", on_done=lambda h: done.append(h.tag))
            host.submit("Tea", params, priority=-1, tag="urgent", on_done=lambda h: done.append(h.tag))
        wait_for(lambda: len(done) == 7, 60, "the requests")
    finally:
        host.close()
    assert done == ["urgent", "soon0", "soon1", "soon2", "late0", "late1", "late2"]
