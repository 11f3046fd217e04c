"""``conveyor_shard_turns`` and ``conveyor_shard_affinity_hits``: shards this worker's turns
ran, and how many of them were of a group it had served last (its prefix cache likely holding
their shared prefix: ``conveyor.worker.execution.shard_affinity``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.worker.execution.shard_affinity import ShardAffinity


class AffinityCollector(Collector):
    def __init__(self, affinity: ShardAffinity, model: str) -> None:
        self._affinity, self._model = affinity, model

    def collect(self) -> Iterator[Metric]:
        turns = CounterMetricFamily("conveyor_shard_turns", "Shards this worker's turns ran.", labels=["model"])
        turns.add_metric([self._model], float(self._affinity.turns))
        yield turns
        hits = CounterMetricFamily(
            "conveyor_shard_affinity_hits",
            "Shards this worker ran that were of a group of shards it had just served (a shared prefix).",
            labels=["model"],
        )
        hits.add_metric([self._model], float(self._affinity.hits))
        yield hits
