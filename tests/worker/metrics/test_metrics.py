"""A worker's ``/metrics`` (``conveyor worker --metrics-port``), scraped over HTTP from a real
worker subprocess and read with ``prometheus_client``'s parser, checked against what its job
did: items, tokens and latencies from the stored items, the engine's state, and the
database's jobs, shards and workers. And the execution layer's item listeners, which feed
the item metrics: each newly stored item once."""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from conveyor.worker.broker.app_state import AppState
from conveyor.worker.broker.worker_process import _serve_metrics
from conveyor.worker.core.settings import ConfigError, Settings
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import _ItemBuffer
from conveyor.worker.jobs.model_names import canonical_model
from conveyor.worker.jobs.submission import SubmitOptions, submit_job
from conveyor.worker.metrics.item_metrics import ItemMetrics
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.items import ItemRecord
from conveyor.worker.store.models import Item, ItemStatus
from conveyor.worker.store.schema import upgrade_database
from tests.worker.helpers import ENGINE, jsonl, openai_lines, parse_lines, scrape, wait_for
from tests.worker.services import free_port

COMPLETIONS = "/v1/completions"


def test_a_worker_s_metrics_add_up_to_what_its_job_did(pg_redis_s3_stack, spawn_worker) -> None:
    # A short context, so that one long prompt is refused by the engine: a failed item.
    stack = pg_redis_s3_stack.with_values(
        engine_args={**ENGINE, "max_model_len": 48}, metrics_cache_seconds=0.2, worker_live_seconds=30
    )
    model = canonical_model(stack.model)
    port = free_port()
    worker = spawn_worker(stack, args=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"))
    worker.wait_ready()
    assert f"metrics at http://127.0.0.1:{port}/metrics" in worker.log()
    m = wait_for(
        lambda: (s := scrape(port)).value("conveyor_workers_live", model=model) == 1 and s, 10, "the worker to be live"
    )
    assert m.value("conveyor_items_total", model=model, status="succeeded") == 0
    assert m.value("conveyor_shards_waiting", model=model) == 0

    n = 6
    long = {"custom_id": "long", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "soup " * 80}}
    lines = [*openai_lines(n, url=COMPLETIONS, max_tokens=8, ignore_eos=True), long]
    client = Client(stack.settings)
    job = client.submit(jsonl(lines), stack.model, shard_size=3)
    job = client.wait(job["id"], timeout=90, poll=0.2)
    assert job["status"] == "completed" and job["request_counts"] == {"total": 7, "completed": n, "failed": 1}
    usage = [r["response"]["body"]["usage"] for r in parse_lines(client.results(job["id"]))]
    errors = parse_lines(client.results(job["id"], errors=True))
    assert [e["response"]["body"]["error"]["code"] for e in errors] == ["prompt_too_long"]
    db = create_db_engine(stack.settings.database)
    with db.connect() as conn:
        sums = conn.execute(
            select(func.sum(Item.ttft), func.sum(Item.tpot), func.sum(Item.queue_time), func.sum(Item.e2e)).where(
                Item.job_id == job["id"]
            )
        ).one()
    db.dispose()
    client.close()

    m = wait_for(lambda: (s := scrape(port)).value("conveyor_jobs", status="completed") == 1 and s, 10, "the job")
    assert m.status == 200
    # Items and tokens: what the job's results and errors files say.
    assert m.value("conveyor_items_total", model=model, status="succeeded") == n
    assert m.value("conveyor_items_total", model=model, status="failed") == 1
    assert m.value("conveyor_item_errors_total", model=model, code="prompt_too_long") == 1
    prompt_tokens = sum(u["prompt_tokens"] for u in usage)
    cached_tokens = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert m.value("conveyor_prompt_tokens_total", model=model) == prompt_tokens > 0
    assert m.value("conveyor_cached_prompt_tokens_total", model=model) == cached_tokens
    assert m.value("conveyor_generation_tokens_total", model=model) == sum(u["completion_tokens"] for u in usage)
    assert sum(u["completion_tokens"] for u in usage) == n * 8
    # Latencies: one observation per succeeded item, summing to the stored items' timings.
    for name, total in zip(
        (
            "conveyor_time_to_first_token_seconds",
            "conveyor_time_per_output_token_seconds",
            "conveyor_request_queue_time_seconds",
            "conveyor_e2e_request_latency_seconds",
        ),
        sums,
        strict=True,
    ):
        assert m.value(f"{name}_count", model=model) == n, name
        assert m.value(f"{name}_sum", model=model) == pytest.approx(total, rel=1e-9, abs=1e-12), name
        assert m.value(f"{name}_bucket", model=model, le="+Inf") == n, name
    # The engine: idle again, and it computed what the items say.
    assert m.value("conveyor_engine_running_requests", model=model) == 0
    assert m.value("conveyor_engine_waiting_requests", model=model) == 0
    assert m.value("conveyor_preemptions_total", model=model) == 0
    assert m.value("conveyor_engine_generated_tokens_total", model=model) == n * 8
    assert m.value("conveyor_engine_prefill_tokens_total", model=model) == prompt_tokens - cached_tokens
    assert m.value("conveyor_engine_steps_total", model=model) >= 8
    assert 0 <= m.value("conveyor_kv_cache_usage_ratio", model=model) <= 1
    assert m.value("conveyor_kv_cache_blocks", model=model) == ENGINE["num_kv_blocks"]
    assert 0 <= m.value("conveyor_prefix_cache_hit_rate", model=model) <= 1
    assert 1 <= m.value("conveyor_engine_cpu_threads", model=model) <= len(os.sched_getaffinity(0))
    # The database: this test's schema holds this one job, all its shards done.
    assert m.value("conveyor_metrics_database_up") == 1
    assert {s.labels["status"]: s.value for s in m.find("conveyor_jobs") if s.value} == {"completed": 1}
    assert m.value("conveyor_shards_waiting", model=model) == 0
    assert m.value("conveyor_shards_in_flight", model=model) == 0
    assert m.value("conveyor_workers_live", model=model) == 1
    assert m.find("process_resident_memory_bytes")


def test_a_worker_that_cannot_serve_its_metrics_exits_before_consuming(embedded_stack, spawn_worker) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        busy = spawn_worker(embedded_stack, args=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"))
        assert busy.proc.wait(60) == 1
    assert f"cannot serve metrics on 127.0.0.1:{port} (CONVEYOR_METRICS_PORT)" in busy.log()
    assert " ready." not in busy.log()


def test_metrics_refuse_a_pool_of_several_processes(tmp_path) -> None:
    """A prefork pool's children would do the work where the server cannot count it. (Celery
    reads ``--pool=prefork`` as "the configured default", threads, so only code can ask.)"""
    state = AppState(Settings(home=tmp_path, metrics_port=free_port()), "org/model", "q")
    with pytest.raises(ConfigError, match="CONVEYOR_METRICS_PORT needs a single-process pool"):
        _serve_metrics(state, "<class 'celery.concurrency.prefork.TaskPool'>")
    assert state.metrics is None


def test_item_listeners_hear_each_newly_stored_item_once_and_a_failing_one_harms_nothing(tmp_path) -> None:
    settings = Settings(home=tmp_path / "home")
    upgrade_database(settings.database)
    ctx = WorkerContext.create(settings, "org/model", host_factory=lambda: pytest.fail("no engine here"))
    job = submit_job(
        ctx.db, ctx.store, settings, io.BytesIO(jsonl(openai_lines(3))), SubmitOptions("org/model"), enqueue=None
    )
    registry = CollectorRegistry()
    metrics = ItemMetrics(registry, ctx.model)
    heard: list[list[str]] = []

    def broken(records: Sequence[ItemRecord]) -> None:
        raise RuntimeError("a broken observer")

    ctx.item_listeners += [broken, lambda records: heard.append([r.custom_id for r in records]), metrics.observe]

    def item(custom_id: str, tokens: int) -> ItemRecord:
        return ItemRecord(job["id"], custom_id, 0, 1, ItemStatus.succeeded, prompt_tokens=tokens, ttft=0.5)

    buffer = _ItemBuffer(ctx)
    for record in (item("req-0", 5), item("req-1", 7), item("req-0", 11)):  # a duplicate in one batch
        buffer.add(record)
    buffer.flush()
    for record in (item("req-1", 13), item("req-2", 17)):  # req-1 again: a redelivered shard
        buffer.add(record)
    buffer.flush()
    assert heard == [["req-0", "req-1"], ["req-2"]] and buffer.stored == 3

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model": "org/model", **labels})

    assert sample("conveyor_items_total", status="succeeded") == 3
    assert sample("conveyor_prompt_tokens_total") == 5 + 7 + 17  # the stored copies only
    assert sample("conveyor_time_to_first_token_seconds_count") == 3
    assert sample("conveyor_time_per_output_token_seconds_count") == 0
    ctx.close()
