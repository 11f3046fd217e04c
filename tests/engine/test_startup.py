"""The engine times its own start (``LLMEngine.startup``), and a process knows when it started
(``conveyor.engine.core.startup.process_start_time``): what a worker's cold start and ``conveyor bench
--cold-start`` are built from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conveyor.engine import EngineConfig, LLMEngine, StartupTimings
from conveyor.engine.core.startup import KERNEL, process_start_time


def test_the_engine_times_each_phase_of_its_start(tiny_models) -> None:
    before = time.time()
    engine = LLMEngine(EngineConfig(tiny_models("llama"), device="cpu", num_kv_blocks=64))
    after = time.time()
    t = engine.startup
    assert isinstance(t, StartupTimings)
    assert before <= t.started_at <= after
    assert t.weights > 0 and 0 < t.tokenizer <= t.weights
    assert t.kv_cache >= 0
    assert t.cuda_graphs is None  # CPU: none captured
    assert t.weights + t.kv_cache <= t.total <= after - before
    assert t.other == t.total - t.weights - t.kv_cache >= 0
    assert engine.runner.startup is t  # the runner adds its phases to the engine's timings


def test_a_process_knows_when_the_kernel_started_it() -> None:
    started_at, source = process_start_time()
    assert source == KERNEL  # Linux: /proc/self/stat
    assert started_at <= time.time()
    # A fresh process's start, measured inside it, is within a moment of when we started it.
    code = "import json; from conveyor.engine.core.startup import process_start_time as p; print(json.dumps(p()))"
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    ).stdout
    child_started, child_source = json.loads(out)
    assert child_source == KERNEL
    assert before - 0.05 <= child_started <= before + 1.0
