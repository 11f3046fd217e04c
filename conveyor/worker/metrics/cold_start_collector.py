"""The worker's cold start at scrape time: ``conveyor_worker_cold_start_seconds{phase=...}``,
the seconds from its process's start to ready spent in each phase (``import``, ``weights``,
``kv_cache``, ``cuda_graphs``, ``other``; they add up to ``total``), read from the context
(``WorkerContext.cold_start``). No samples until the worker is ready; ``cuda_graphs`` is 0
when none were captured (CPU), a phase the worker has not been through (its model not
loaded yet) has no sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.worker.execution.cold_start import ColdStart

NAME = "conveyor_worker_cold_start_seconds"


class ColdStartCollector(Collector):
    def __init__(self, cold_start: Callable[[], ColdStart | None], model: str) -> None:
        self._cold_start = cold_start
        self._model = model

    def describe(self) -> Iterator[Metric]:
        yield self._family(None)

    def collect(self) -> Iterator[Metric]:
        yield self._family(self._cold_start())

    def _family(self, cold: ColdStart | None) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            NAME,
            'Seconds from the worker process\'s start to ready, by phase (they add up to phase="total").',
            labels=["model", "phase"],
        )
        if cold is not None:
            for phase, value in cold.phases.items():
                if value is None and phase == "cuda_graphs" and cold.model_loaded:
                    value = 0.0  # none captured (CPU, enforce_eager)
                if value is not None:
                    family.add_metric([self._model, phase], value)
            family.add_metric([self._model, "total"], cold.total)
        return family
