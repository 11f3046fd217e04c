"""The database's metrics (``conveyor/worker/metrics/db_collector.py``), served over real HTTP and read
with ``prometheus_client``'s parser: jobs by status, per model the demand, the shards waiting
and in flight and the live workers, the read cache, and a database that cannot be reached."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import event
from sqlalchemy.engine import Engine

from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.finalize import finalize_if_ready
from conveyor.worker.jobs.lifecycle import cancel_job
from conveyor.worker.jobs.submission import SubmitOptions, create_job, submit_job
from conveyor.worker.metrics.db_collector import DatabaseCollector, metrics_db_engine
from conveyor.worker.metrics.exposition import ApiMetrics
from conveyor.worker.metrics.server import MetricsServer
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.leases import acquire_lease, release_lease
from conveyor.worker.store.models import JobStatus, ShardStatus, WorkerState
from conveyor.worker.store.objects.local import LocalStore
from conveyor.worker.store.schema import upgrade_database
from conveyor.worker.store.workers import register_worker, set_worker_state
from tests.worker.helpers import Scrape, jsonl, openai_lines, scrape
from tests.worker.services import PG_HOST, PG_PORT
from tests.worker.tcp_proxy import TcpProxy

MODEL_A, MODEL_B = "org/model-a", "org/model-b"


@pytest.fixture
def serve():
    """``serve(collector)`` serves it at ``/metrics`` on a free port; returns the port."""
    servers: list[MetricsServer] = []

    def start(collector: DatabaseCollector) -> int:
        registry = CollectorRegistry()
        registry.register(collector)
        servers.append(MetricsServer(registry, "127.0.0.1", 0))
        return servers[-1].port

    yield start
    for server in servers:
        server.close()


def _settings(tmp_path, db_url: str) -> Settings:
    return Settings(home=tmp_path / "home", database_url=db_url, storage_url=(tmp_path / "objects").as_uri())


def _submit(db: Engine, tmp_path, settings: Settings, model: str, n: int, shard_size: int) -> str:
    """A job of ``n`` requests in shards of ``shard_size`` (in input order, so the count is exact),
    enqueued nowhere: no worker runs it."""
    job = submit_job(
        db,
        LocalStore(tmp_path / "objects"),
        settings,
        io.BytesIO(jsonl(openai_lines(n))),
        SubmitOptions(model=model, shard_size=shard_size, shard_order="input"),
        enqueue=lambda job_id, shards: None,
    )
    assert job["status"] == "in_progress" and job["num_shards"] == -(-n // shard_size), job
    return job["id"]


def _shards(m: Scrape, model: str) -> tuple[float, float]:
    return m.value("conveyor_shards_waiting", model=model), m.value("conveyor_shards_in_flight", model=model)


def test_shards_wait_for_a_worker_then_fly_under_its_lease_and_wait_again_when_it_expires(
    db_engine, db_url, tmp_path, serve
) -> None:
    settings = _settings(tmp_path, db_url)
    job_a = _submit(db_engine, tmp_path, settings, MODEL_A, 7, 2)  # 4 shards
    job_b = _submit(db_engine, tmp_path, settings, MODEL_B, 3, 3)  # 1 shard, then cancelled
    cancel_job(db_engine, LocalStore(tmp_path / "objects"), job_b)
    port = serve(DatabaseCollector(db_engine, live_seconds=60, cache_seconds=0))

    m = scrape(port)
    assert m.status == 200 and m.content_type.startswith("text/plain")
    assert m.value("conveyor_metrics_database_up") == 1
    jobs = {s.labels["status"]: s.value for s in m.find("conveyor_jobs")}
    assert jobs == {s.value: (1.0 if s in (JobStatus.in_progress, JobStatus.cancelled) else 0.0) for s in JobStatus}
    assert _shards(m, MODEL_A) == (4, 0)
    assert m.find("conveyor_shards_waiting", model=MODEL_B) == []  # cancelled: its shards need no one
    assert m.value("conveyor_workers_live", model=MODEL_A) == 0

    # A worker takes two shards: one holds its lease, the other's lease runs out (it died).
    assert acquire_lease(db_engine, job_a, 0, "worker-1", 60.0)
    assert acquire_lease(db_engine, job_a, 1, "worker-2", 0.5)
    registry_id = register_worker(db_engine, MODEL_A, "q")
    set_worker_state(db_engine, registry_id, WorkerState.ready)
    m = scrape(port)
    assert _shards(m, MODEL_A) == (2, 2)
    assert m.value("conveyor_workers_live", model=MODEL_A) == 1
    time.sleep(0.6)
    assert _shards(scrape(port), MODEL_A) == (3, 1)

    # Cancelled: pending shards are done with; the running ones still need a worker to stop.
    cancel_job(db_engine, LocalStore(tmp_path / "objects"), job_a)
    m = scrape(port)
    assert _shards(m, MODEL_A) == (1, 1)
    assert m.value("conveyor_jobs", status="cancelling") == 1 and m.value("conveyor_jobs", status="cancelled") == 1
    assert release_lease(db_engine, job_a, 0, "worker-1", ShardStatus.cancelled)
    assert acquire_lease(db_engine, job_a, 1, "worker-3", 60.0)
    assert release_lease(db_engine, job_a, 1, "worker-3", ShardStatus.cancelled)
    assert _shards(scrape(port), MODEL_A) == (0, 0)  # still reported: a drained queue reads 0, not nothing


def test_the_api_metrics_render_the_same_counts_in_either_format(db_engine, db_url, tmp_path) -> None:
    settings = _settings(tmp_path, db_url).model_copy(update={"metrics_cache_seconds": 0.0})
    _submit(db_engine, tmp_path, settings, MODEL_A, 5, 2)
    metrics = ApiMetrics(settings)
    try:
        body, content_type = metrics.render()
        m = Scrape.parse(body.decode())
        assert content_type.startswith("text/plain; version=0.0.4")
        assert m.value("conveyor_jobs", status="in_progress") == 1
        assert _shards(m, MODEL_A) == (3, 0)
        assert m.find("process_cpu_seconds_total")  # the process's own metrics are there too
        body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
        assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    finally:
        metrics.close()


def _count_statements(db: Engine) -> list[str]:
    statements: list[str] = []
    event.listen(db, "before_cursor_execute", lambda *args: statements.append(args[2]))
    return statements


def test_scrapes_within_the_cache_period_read_the_database_once(tmp_path, serve) -> None:
    db_url = f"sqlite:///{tmp_path / 'conveyor.db'}"
    upgrade_database(db_url)
    db, writer = metrics_db_engine(db_url), create_db_engine(db_url)
    settings = _settings(tmp_path, db_url)
    _submit(writer, tmp_path, settings, MODEL_A, 4, 2)
    statements = _count_statements(db)
    port = serve(DatabaseCollector(db, live_seconds=60, cache_seconds=60))

    assert _shards(scrape(port), MODEL_A) == (2, 0)
    reads = len(statements)
    assert reads >= 3
    _submit(writer, tmp_path, settings, MODEL_A, 2, 2)  # one more shard: not seen until the cache expires
    results: list[Scrape] = []
    threads = [threading.Thread(target=lambda: results.append(scrape(port))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and all(_shards(m, MODEL_A) == (2, 0) for m in results)
    assert len(statements) == reads  # nine scrapes, one read
    db.dispose()
    writer.dispose()


@pytest.fixture
def proxied_pg(pg_url: str, tcp_proxy) -> Iterator[tuple[str, TcpProxy]]:
    proxy = tcp_proxy(PG_HOST, PG_PORT)
    upgrade_database(pg_url)
    yield pg_url.replace(f"{PG_HOST}:{PG_PORT}", proxy.url_host()), proxy


def test_a_scrape_succeeds_while_the_database_is_down_and_says_so(proxied_pg, serve) -> None:
    url, proxy = proxied_pg
    db = metrics_db_engine(url, timeout_seconds=2.0)
    port = serve(DatabaseCollector(db, live_seconds=60, cache_seconds=0, timeout_seconds=2.0))
    m = scrape(port)
    assert m.value("conveyor_metrics_database_up") == 1 and m.value("conveyor_jobs", status="in_progress") == 0

    proxy.cut()
    start = time.monotonic()
    m = scrape(port)
    assert m.status == 200
    assert m.value("conveyor_metrics_database_up") == 0
    assert m.find("conveyor_jobs") == [] and m.find("conveyor_shards_waiting") == []  # no stale numbers
    assert time.monotonic() - start < 5

    proxy.restore()
    m = scrape(port)
    assert m.value("conveyor_metrics_database_up") == 1 and m.value("conveyor_jobs", status="in_progress") == 0
    db.dispose()


def test_a_database_without_the_schema_reads_as_down(tmp_path, serve) -> None:
    db = metrics_db_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    m = scrape(serve(DatabaseCollector(db, live_seconds=60, cache_seconds=0)))
    assert m.status == 200 and m.value("conveyor_metrics_database_up") == 0
    db.dispose()


def test_demand_counts_every_piece_of_work_that_needs_a_worker(db_engine, db_url, tmp_path) -> None:
    """``conveyor_demand``: shards waiting and in flight, a batch no worker has ingested yet,
    and a job whose finalisation is due; the catalog's models read 0 before any work came."""
    declared = "org/declared"
    settings = _settings(tmp_path, db_url).model_copy(update={"metrics_cache_seconds": 0.0, "models": (declared,)})
    store = LocalStore(tmp_path / "objects")
    metrics = ApiMetrics(settings)

    def read(model: str) -> tuple[float, float]:
        m = Scrape.parse(metrics.render()[0].decode())
        return m.value("conveyor_demand", model=model), m.value("conveyor_jobs_waiting", model=model)

    try:
        assert read(declared) == (0, 0)  # reported before any work came: a trigger reads 0, not nothing
        store.put_bytes("inputs/a.jsonl", jsonl(openai_lines(3)))
        uri = store.uri("inputs/a.jsonl")
        validating, _ = create_job(db_engine, store, settings, uri, SubmitOptions(model=MODEL_A))
        assert validating["status"] == "validating"
        assert read(MODEL_A) == (1, 1)  # a batch whose intake no worker has run: it needs one
        running = _submit(db_engine, tmp_path, settings, MODEL_A, 5, 2)  # 3 shards
        assert read(MODEL_A) == (4, 1)
        assert acquire_lease(db_engine, running, 0, "worker-1", 60.0)
        assert read(MODEL_A) == (4, 1)  # in flight counts as much as waiting
        for index in range(3):
            assert index == 0 or acquire_lease(db_engine, running, index, "worker-1", 60.0)
            assert release_lease(db_engine, running, index, "worker-1", ShardStatus.completed)
        assert read(MODEL_A) == (2, 2)  # every shard done, the job not finalised: its finaliser is due
        assert finalize_if_ready(db_engine, store, running) is not None
        assert read(MODEL_A) == (1, 1)
        cancel_job(db_engine, store, validating["id"])
        assert read(MODEL_A) == (0, 0) and read(declared) == (0, 0)
    finally:
        metrics.close()
