"""Finished items are stored once per (job, custom_id), on SQLite and Postgres."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import delete, event, func, select

from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.items import (
    ItemRecord,
    record_finished_items,
    record_shard_counts,
    refresh_job_counts,
    stored_custom_ids,
    summarize_job,
)
from conveyor.worker.store.models import Item, ItemStatus, Job, JobStatus, Shard


def _make_job(engine, job_id: str = "batch_1", total: int = 4, invalid: int = 1) -> None:
    with make_sessionmaker(engine).begin() as session:
        session.add(Job(id=job_id, model="m", shard_size=2, total_requests=total, invalid_requests=invalid))
        session.add(Shard(job_id=job_id, shard_index=0, first_line=1, last_line=4, num_items=3))


def _item(custom_id: str, line: int, status: ItemStatus = ItemStatus.succeeded, **kw) -> ItemRecord:
    return ItemRecord(job_id="batch_1", custom_id=custom_id, shard_index=0, line=line, status=status, **kw)


def test_the_same_item_twice_is_stored_once(db_engine) -> None:
    _make_job(db_engine)
    first = _item("a", 1, response={"choices": [{"text": "first"}]}, prompt_tokens=3, ttft=0.1)
    assert record_finished_items(db_engine, [first]) == ["a"]
    again = _item("a", 1, response={"choices": [{"text": "second"}]})
    assert record_finished_items(db_engine, [again, _item("b", 2)]) == ["b"]
    assert record_finished_items(db_engine, [again]) == []
    with make_sessionmaker(db_engine)() as session:
        assert session.scalar(select(func.count()).select_from(Item)) == 2
        stored = session.get(Item, ("batch_1", "a"))
        assert stored is not None
        assert stored.response == {"choices": [{"text": "first"}]}  # the first copy wins
        assert stored.status is ItemStatus.succeeded and stored.prompt_tokens == 3 and stored.ttft == 0.1


def test_duplicates_inside_one_batch_and_many_rows(db_engine) -> None:
    _make_job(db_engine)
    rows = [_item(f"id-{i}", i) for i in range(1500)] + [_item("id-7", 7)]
    assert len(record_finished_items(db_engine, rows)) == 1500
    assert stored_custom_ids(db_engine, "batch_1", 0) == {f"id-{i}" for i in range(1500)}
    assert stored_custom_ids(db_engine, "batch_1", 1) == set()
    assert record_finished_items(db_engine, []) == []


def test_request_counts_are_derived_from_items(db_engine) -> None:
    _make_job(db_engine, total=4, invalid=1)
    record_finished_items(
        db_engine,
        [_item("a", 1), _item("b", 2), _item("c", 3, ItemStatus.failed, status_code=400, error={"code": "x"})],
    )
    assert refresh_job_counts(db_engine, "batch_1") == (4, 2, 2)
    record_finished_items(db_engine, [_item("a", 1)])
    assert refresh_job_counts(db_engine, "batch_1") == (4, 2, 2)
    with make_sessionmaker(db_engine)() as session:
        job = session.get(Job, "batch_1")
        assert job is not None
        assert job.status is JobStatus.validating and job.failed_requests == 2


def test_a_shard_release_counts_its_own_items_and_sums_the_shards(db_engine) -> None:
    """What a release reads does not grow with the job: its shard's items, through the
    (job_id, shard_index) index, and the job's shard rows, never the job's other items."""
    with make_sessionmaker(db_engine).begin() as session:
        session.add(Job(id="batch_1", model="m", shard_size=2, total_requests=6, invalid_requests=1))
        for index in range(3):
            session.add(Shard(job_id="batch_1", shard_index=index, first_line=1, last_line=6, num_items=2))
    failed = {"status_code": 400, "error": {"code": "x"}}
    record_finished_items(
        db_engine,
        [
            _item("a", 1),
            _item("b", 2, ItemStatus.failed, **failed),
            ItemRecord(job_id="batch_1", custom_id="c", shard_index=1, line=3, status=ItemStatus.succeeded),
            ItemRecord(job_id="batch_1", custom_id="d", shard_index=1, line=4, status=ItemStatus.succeeded),
        ],
    )
    assert record_shard_counts(db_engine, "batch_1", 0) == (6, 1, 2)  # shard 1 not released yet
    with db_engine.begin() as conn:  # shard 0's items gone: a later release must not notice
        conn.execute(delete(Item).where(Item.shard_index == 0))
    statements: list[tuple[str, object]] = []

    def capture(_conn, _cursor, statement, parameters, _context, _many) -> None:
        statements.append((statement, parameters))

    event.listen(db_engine, "before_cursor_execute", capture)
    try:
        assert record_shard_counts(db_engine, "batch_1", 1) == (6, 3, 2)
        assert record_shard_counts(db_engine, "batch_1", 1) == (6, 3, 2)  # redone: the same
    finally:
        event.remove(db_engine, "before_cursor_execute", capture)
    assert len(statements) == 6  # per release: the shard's counts, the job's sums, the answer
    if db_engine.dialect.name == "sqlite":
        with db_engine.connect() as conn:
            for statement, parameters in statements:
                plan = " | ".join(row[3] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters))
                for step in plan.split(" | "):
                    if " items" in step:
                        assert "INDEX ix_items_job_shard (job_id=? AND shard_index=?)" in step, plan


def test_job_renders_as_an_openai_batch_object(db_engine) -> None:
    _make_job(db_engine, total=4, invalid=1)
    record_finished_items(db_engine, [_item("a", 1, prompt_tokens=5, completion_tokens=2)])
    refresh_job_counts(db_engine, "batch_1")
    with make_sessionmaker(db_engine)() as session:
        job = session.get(Job, "batch_1")
        assert job is not None
        obj = job.as_batch_object()
    assert obj["object"] == "batch" and obj["status"] == "validating" and obj["errors"] is None
    assert obj["request_counts"] == {"total": 4, "completed": 1, "failed": 1}
    assert isinstance(obj["created_at"], int) and obj["completed_at"] is None


def test_summarize_job_sums_usage_and_latency_percentiles(db_engine) -> None:
    _make_job(db_engine)
    record_finished_items(
        db_engine,
        [
            _item(f"i{k}", k, prompt_tokens=10, cached_tokens=4, completion_tokens=k, ttft=k / 10, preemptions=k % 2)
            for k in range(1, 11)
        ]
        + [_item("err", 11, ItemStatus.failed, status_code=400)],
    )
    metrics = summarize_job(db_engine, "batch_1")
    assert metrics["items"] == 11 and metrics["preemptions"] == 5
    assert metrics["ttft"]["p50"] in (0.5, 0.6) and metrics["ttft"]["max"] == 1.0 and metrics["e2e"] is None
    with make_sessionmaker(db_engine)() as session:
        job = session.get(Job, "batch_1")
        assert job is not None
        assert (job.prompt_tokens, job.cached_tokens, job.completion_tokens) == (100, 40, 55)
        assert job.metrics == metrics


def test_latency_percentiles_are_exact_ranks_of_the_sorted_values(db_engine) -> None:
    rng = random.Random(7)
    ttfts = [round(rng.uniform(0.01, 5.0), 6) for _ in range(257)]
    _make_job(db_engine)
    record_finished_items(db_engine, [_item(f"i{k}", k, ttft=t) for k, t in enumerate(ttfts)] + [_item("no-ttft", 999)])
    got = summarize_job(db_engine, "batch_1")["ttft"]
    ordered = sorted(ttfts)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        assert got[name] == pytest.approx(ordered[round(q * 256)])
    assert got["max"] == pytest.approx(ordered[-1]) and got["mean"] == pytest.approx(sum(ttfts) / len(ttfts))
