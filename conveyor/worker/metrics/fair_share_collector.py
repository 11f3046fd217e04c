"""How the worker's engine is shared between owners, at scrape time (from the engine host's
latest stats: ``HostStats.owners``, kept by its ``FairFeed``).

Owners are never labels (their number is unbounded, and a key id is not for a dashboard):
the owners are ranked by their requests in the engine and the first ``RANKS`` get a rank
label, the others are summed under ``rest``.

- ``conveyor_fair_share_ratio``: the fair-share figure. Of the owners with requests waiting
  for the engine, the smallest share of the engine's requests held, over an equal share
  (the engine's requests over the owners with work), at most 1. 1: every owner that wants
  more has at least an equal share; 0: one has requests waiting and none in the engine.
- ``conveyor_fair_share_owners{state}``: owners with requests in the engine (``served``) and
  with requests waiting for it (``waiting``).
- ``conveyor_owner_share{rank}``, ``conveyor_owner_waiting_requests{rank}``: the share of the
  engine's requests of the owner at that rank, and its requests waiting.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric

from conveyor.worker.execution.engine_host import HostStats
from conveyor.worker.execution.fair_feed import OwnerLoad
from conveyor.worker.metrics.host_stats_collector import HostStatsCollector

RANKS = 4


def fair_share_ratio(loads: Sequence[OwnerLoad]) -> float:
    """The fair-share figure of ``loads`` (see the module's docstring)."""
    active = [load for load in loads if load.served or load.waiting]
    served = sum(load.served for load in active)
    wanting = [load for load in active if load.waiting]
    if not wanting or not served:
        return 1.0
    equal = served / len(active)
    return min(1.0, min(load.served for load in wanting) / equal)


class FairShareCollector(HostStatsCollector):
    def _part(self, host: HostStats) -> Sequence[OwnerLoad]:
        return host.owners

    def _families(self, loads: Sequence[OwnerLoad] | None) -> Iterator[Metric]:
        model = self._model
        ratio = GaugeMetricFamily(
            "conveyor_fair_share_ratio",
            "Of the owners with requests waiting for the engine, the smallest share of the engine held over an "
            "equal share (1: fair; 0: an owner waits with nothing in the engine).",
            labels=["model"],
        )
        owners = GaugeMetricFamily(
            "conveyor_fair_share_owners",
            "Owners with requests in the engine or waiting for it.",
            labels=["model", "state"],
        )
        share = GaugeMetricFamily(
            "conveyor_owner_share",
            "Share of the engine's requests held by the owner at this rank (1: the most; rest: the others summed).",
            labels=["model", "rank"],
        )
        waiting = GaugeMetricFamily(
            "conveyor_owner_waiting_requests",
            "Requests waiting for the engine of the owner at this rank (ranked by requests in the engine).",
            labels=["model", "rank"],
        )
        if loads is not None:
            ratio.add_metric([model], fair_share_ratio(loads))
            owners.add_metric([model, "served"], float(sum(1 for load in loads if load.served)))
            owners.add_metric([model, "waiting"], float(sum(1 for load in loads if load.waiting)))
            total = sum(load.served for load in loads) or 1
            ranked, rest = loads[:RANKS], loads[RANKS:]
            for rank, load in enumerate(ranked, start=1):
                share.add_metric([model, str(rank)], load.served / total)
                waiting.add_metric([model, str(rank)], float(load.waiting))
            if rest:
                share.add_metric([model, "rest"], sum(load.served for load in rest) / total)
                waiting.add_metric([model, "rest"], float(sum(load.waiting for load in rest)))
        yield from (ratio, owners, share, waiting)
