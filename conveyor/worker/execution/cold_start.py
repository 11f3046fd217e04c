"""A worker's cold start: from its process's start to ready, by phase.

- ``import``: process start (the kernel's record, ``conveyor.engine.core.startup.process_start_time``) to
  the model beginning to load: the interpreter, Conveyor's, Celery's and torch's imports,
  the settings, the schema check, the registry, the store check, the metrics server;
- ``weights``: the model and its tokenizer, a download included (``s3://`` weights fetched
  into the model cache: ``download``; a hub download happens inside the engine);
- ``kv_cache``: sizing and allocating the KV cache;
- ``cuda_graphs``: capturing the decode graphs (None, "off", when none were: CPU);
- ``other``: the rest: the engine's other set-up, then the model loaded to the worker ready
  (the Celery consumer connecting to the broker, the background threads);
- ``total``: process start to ready. The phases add up to it.

The engine times its own phases (``LLMEngine.startup``); the context records when the load
began and ended (``ModelLoad``) and, once the worker is ready, keeps the breakdown
(``WorkerContext.cold_start``) for the log line and the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PHASES = ("import", "weights", "kv_cache", "cuda_graphs", "other")


@dataclass(frozen=True)
class ModelLoad:
    """How the process's model load went: when it began and ended (``time.time()``), the
    seconds its download took (None: nothing to fetch) and the engine's own timings
    (``conveyor.engine.StartupTimings``; None for an engine that keeps none)."""

    started_at: float
    finished_at: float
    download: float | None
    engine: Any | None


@dataclass(frozen=True)
class ColdStart:
    process_started_at: float  # time.time() seconds
    process_start_source: str  # "kernel", "psutil" or "module import" (then an underestimate)
    ready_at: float
    phases: dict[str, float | None]  # PHASES; None for cuda_graphs when none were captured
    total: float
    download: float | None  # part of weights
    tokenizer: float | None  # part of weights
    model_loaded: bool  # False: ready before loading it (a prefork pool's children load their own)

    @classmethod
    def measure(cls, process_started_at: float, source: str, load: ModelLoad | None, ready_at: float) -> ColdStart:
        total = max(0.0, ready_at - process_started_at)
        engine = load.engine if load is not None else None
        phases: dict[str, float | None]
        if load is None:
            phases = {"import": total, "weights": None, "kv_cache": None, "cuda_graphs": None}
        else:
            imports = max(0.0, load.started_at - process_started_at)
            if engine is not None:
                # From the load's start to the engine's: the download, the engine's imports.
                weights = max(0.0, engine.started_at - load.started_at) + engine.weights
                kv, graphs = engine.kv_cache, engine.cuda_graphs
            else:
                weights, kv, graphs = max(0.0, load.finished_at - load.started_at), 0.0, None
            phases = {"import": imports, "weights": weights, "kv_cache": kv, "cuda_graphs": graphs}
        phases["other"] = max(0.0, total - sum(v or 0.0 for v in phases.values()))
        return cls(
            process_started_at=process_started_at,
            process_start_source=source,
            ready_at=ready_at,
            phases=phases,
            total=total,
            download=load.download if load is not None else None,
            tokenizer=engine.tokenizer if engine is not None else None,
            model_loaded=load is not None,
        )

    def describe(self) -> str:
        """One line: ``cold start 6.2 s: import 3.1 s, weights 2.0 s, ...``."""

        def show(name: str) -> str:
            value = self.phases[name]
            if value is None:
                return f"{name} off" if name == "cuda_graphs" else f"{name} -"
            extra = []
            if name == "weights" and self.download is not None:
                extra.append(f"download {self.download:.1f} s")
            if name == "weights" and self.tokenizer is not None:
                extra.append(f"tokenizer {self.tokenizer:.1f} s")
            return f"{name} {value:.1f} s" + (f" ({', '.join(extra)})" if extra else "")

        note = "" if self.model_loaded else " (model not loaded yet: each pool process loads it on first use)"
        source = "" if self.process_start_source != "module import" else " (from the first import: an underestimate)"
        return f"cold start {self.total:.1f} s{source}{note}: " + ", ".join(show(name) for name in PHASES)

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            **self.phases,
            "download": self.download,
            "tokenizer": self.tokenizer,
            "process_start_source": self.process_start_source,
        }
