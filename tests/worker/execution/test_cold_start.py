"""A worker's cold start, measured and reported: the breakdown by phase from the tiny local
model, the one line a real ``conveyor worker`` logs when ready and the gauge its
``/metrics`` exports (``conveyor_worker_cold_start_seconds{phase}``), and ``conveyor bench
--cold-start`` timing fresh processes."""

from __future__ import annotations

import json
import re
import time

import pytest
from prometheus_client import CollectorRegistry

from conveyor.worker.core.settings import Settings
from conveyor.worker.entrypoints.cli import main
from conveyor.worker.execution.cold_start import PHASES, ColdStart, ModelLoad
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.jobs.model_names import canonical_model
from conveyor.worker.metrics.cold_start_collector import NAME, ColdStartCollector
from conveyor.worker.store.schema import upgrade_database
from tests.worker.helpers import scrape
from tests.worker.services import free_port

LINE = re.compile(
    r"cold start (?P<total>[\d.]+) s: import [\d.]+ s, weights [\d.]+ s \(tokenizer [\d.]+ s\), "
    r"kv_cache [\d.]+ s, cuda_graphs off, other [\d.]+ s"
)


def _check_phases(phases: dict[str, float | None], total: float, *, cuda_graphs: float | None = None) -> None:
    assert list(phases) == list(PHASES)
    assert phases["cuda_graphs"] == cuda_graphs  # CPU: none captured
    values = [v for v in phases.values() if v is not None]
    assert all(v >= 0 for v in values), phases
    assert sum(values) <= total + 1e-6
    assert sum(values) == pytest.approx(total, abs=1e-6)  # "other" is the rest
    assert (phases["import"] or 0) > 0 and (phases["weights"] or 0) > 0


def test_the_breakdown_of_a_tiny_model_s_start(tmp_path, tiny_model) -> None:
    settings = Settings(home=tmp_path / "home", engine_args={"num_kv_blocks": 64})
    upgrade_database(settings.database)
    ctx = WorkerContext.create(settings, tiny_model)
    registry = CollectorRegistry()
    registry.register(ColdStartCollector(lambda: ctx.cold_start, ctx.model))
    try:
        assert registry.get_sample_value(NAME, {"model": ctx.model, "phase": "total"}) is None  # not ready yet
        ctx.host()
        load = ctx.model_load
        assert load is not None and load.engine is ctx.host().startup and load.download is None
        cold = ctx.mark_ready()
        assert ctx.mark_ready() is cold  # measured once
        _check_phases(cold.phases, cold.total)
        assert cold.process_start_source == "kernel" and cold.model_loaded
        assert cold.process_started_at < load.started_at <= load.finished_at <= cold.ready_at
        assert cold.phases["kv_cache"] == load.engine.kv_cache
        assert LINE.fullmatch(cold.describe()), cold.describe()
        for phase in (*PHASES, "total"):
            value = registry.get_sample_value(NAME, {"model": ctx.model, "phase": phase})
            expected = cold.total if phase == "total" else cold.phases[phase] or 0.0
            assert value == expected, phase  # cuda_graphs: 0 on CPU
    finally:
        ctx.close()


def test_a_worker_ready_before_its_model_loads_says_so() -> None:
    """(A prefork pool's children load their own model: the parent is ready without one.)"""
    cold = ColdStart.measure(100.0, "kernel", None, 103.5)
    assert cold.phases == {"import": 3.5, "weights": None, "kv_cache": None, "cuda_graphs": None, "other": 0.0}
    assert "model not loaded yet" in cold.describe()
    registry = CollectorRegistry()
    registry.register(ColdStartCollector(lambda: cold, "m"))
    assert registry.get_sample_value(NAME, {"model": "m", "phase": "weights"}) is None
    assert registry.get_sample_value(NAME, {"model": "m", "phase": "cuda_graphs"}) is None
    assert registry.get_sample_value(NAME, {"model": "m", "phase": "total"}) == 3.5
    # A download counts in weights, and is said apart.
    engine = type("T", (), {"started_at": 102.0, "weights": 1.0, "tokenizer": 0.5, "kv_cache": 0.25})()
    engine.cuda_graphs = 0.5
    cold = ColdStart.measure(100.0, "kernel", ModelLoad(101.0, 104.0, 0.9, engine), 105.0)
    assert cold.phases == {"import": 1.0, "weights": 2.0, "kv_cache": 0.25, "cuda_graphs": 0.5, "other": 1.25}
    assert "weights 2.0 s (download 0.9 s, tokenizer 0.5 s)" in cold.describe()


def test_a_real_worker_logs_its_cold_start_and_exports_it(embedded_stack, spawn_worker) -> None:
    port = free_port()
    started = time.time()
    worker = spawn_worker(embedded_stack, args=("--metrics-port", str(port), "--metrics-host", "127.0.0.1"))
    worker.wait_ready()
    ready_within = time.time() - started
    found = [match for line in worker.log().splitlines() if (match := LINE.search(line))]
    assert len(found) == 1, worker.log()[-3000:]
    # What the start logs before Celery is ready (the model load, the KV cache) reaches the log.
    assert "loading model" in worker.log() and "KV cache:" in worker.log(), worker.log()[-3000:]
    model = canonical_model(embedded_stack.model)
    metrics = scrape(port)
    phases: dict[str, float | None] = {p: metrics.value(NAME, model=model, phase=p) for p in PHASES}
    total = metrics.value(NAME, model=model, phase="total")
    assert phases["cuda_graphs"] == 0.0  # CPU
    _check_phases({**phases, "cuda_graphs": None}, total)
    assert float(found[0]["total"]) == pytest.approx(total, abs=0.051)  # the log line says the same
    assert total <= ready_within + 1.0  # measured from the process's start, which we saw happen
    assert (phases["import"] or 0) > 0.5  # the interpreter, torch, Celery...: from the kernel's start time


def test_bench_cold_start_times_fresh_processes(tiny_model, capsys) -> None:
    assert main(["bench", "--cold-start", "--model", tiny_model, "--repeat", "2"]) == 0
    text = capsys.readouterr().out
    assert f"cold start of {canonical_model(tiny_model)} on cpu" in text
    runs = re.findall(
        r"run \d+ +total [\d.]+ s: import [\d.]+ s, weights [\d.]+ s, kv_cache [\d.]+ s, cuda_graphs off", text
    )
    assert len(runs) == 2, text
    assert re.search(r"median +total [\d.]+ s: import", text), text

    assert main(["bench", "--cold-start", "--model", tiny_model, "--repeat", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (run,) = result["runs"]
    assert run["device"] == "cpu" and run["process_start_source"] == "kernel"
    _check_phases(run["phases"], run["total"])
    assert result["median"] == {**run["phases"], "total": run["total"]}


def test_bench_cold_start_refuses_a_bad_repeat(tiny_model, capsys) -> None:
    assert main(["bench", "--cold-start", "--model", tiny_model, "--repeat", "0"]) == 1
    assert "repeat must be from 1 to 20" in capsys.readouterr().err
