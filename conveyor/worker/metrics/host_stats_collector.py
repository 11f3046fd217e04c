"""What the collectors reading the engine host's latest stats share: the families described
with no samples before the model is loaded, filled at scrape time from one part of the stats
(``WorkerContext.host_stats``), so a scrape never touches the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from conveyor.worker.execution.engine_host import HostStats


class HostStatsCollector(Collector):
    def __init__(self, stats: Callable[[], HostStats | None], model: str) -> None:
        self._stats = stats
        self._model = model

    def describe(self) -> Iterator[Metric]:
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        host = self._stats()
        yield from self._families(self._part(host) if host is not None else None)

    def _part(self, host: HostStats) -> Any:
        """The part of the stats this collector reports."""
        raise NotImplementedError

    def _families(self, part: Any) -> Iterator[Metric]:
        """The families, with samples from ``part`` (none when it is None)."""
        raise NotImplementedError
