"""The engine's state at scrape time: requests running and waiting, KV-cache usage, the prefix
cache, preemptions, steps and tokens computed, the CPU threads its steps run on, and
speculative decoding's proposals and acceptances (only with it on).

Read from the engine host's latest stats (``WorkerContext.host_stats``: the loop thread
refreshes them every half second while busy), so a scrape never touches the engine. Before
the model is loaded the families are present with no samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from conveyor.worker.execution.engine_host import HostStats
from conveyor.worker.metrics.host_stats_collector import HostStatsCollector


class EngineCollector(HostStatsCollector):
    def _part(self, host: HostStats) -> object:
        return host.engine

    def _families(self, engine: object | None) -> Iterator[Metric]:
        labels = ["model"]

        def gauge(name: str, doc: str, field: str) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            if engine is not None:
                family.add_metric([self._model], float(getattr(engine, field)))
            return family

        def counter(name: str, doc: str, field: str) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            if engine is not None:
                family.add_metric([self._model], float(getattr(engine, field)))
            return family

        yield gauge("conveyor_engine_running_requests", "Requests the engine is running now.", "num_running")
        yield gauge("conveyor_engine_waiting_requests", "Requests waiting in the engine's queue.", "num_waiting")
        yield gauge("conveyor_kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use (0 to 1).", "kv_usage")
        yield gauge("conveyor_kv_cache_blocks", "KV-cache blocks the engine has.", "kv_blocks_total")
        yield gauge(
            "conveyor_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache over prompt tokens looked up, since the engine started.",
            "prefix_cache_hit_rate",
        )
        yield counter(
            "conveyor_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (for a windowed hit rate: rate(hits) / rate(queries)).",
            "prefix_cache_queries",
        )
        yield counter("conveyor_prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits")
        yield counter(
            "conveyor_preemptions", "Requests preempted (out of KV blocks) and recomputed.", "num_preemptions"
        )
        yield counter("conveyor_engine_steps", "Engine iterations (steps).", "num_steps")
        yield counter(
            "conveyor_engine_prefill_tokens",
            "Prompt tokens the engine computed (prefix-cache hits are not computed).",
            "num_prompt_tokens_computed",
        )
        yield counter(
            "conveyor_engine_generated_tokens",
            "Tokens the engine generated, those of aborted requests included.",
            "num_generated_tokens",
        )
        yield gauge(
            "conveyor_engine_cpu_threads",
            "torch's intra-op threads the engine's last step ran on (on CPU, tuned to what the machine gives).",
            "cpu_threads",
        )
        yield from self._spec_decode_families(getattr(engine, "spec_decode", None) if engine is not None else None)

    def _spec_decode_families(self, spec: Any | None) -> Iterator[Metric]:
        """Speculative decoding (``conveyor.engine.SpecDecodeStats``): no samples when it is off. The
        acceptance rate over a window is rate(accepted) / rate(proposed), per position too."""
        model = self._model
        totals = (
            ("conveyor_spec_decode_proposed_tokens", "Tokens proposed by speculative decoding.", "num_proposed_tokens"),
            ("conveyor_spec_decode_accepted_tokens", "Proposed tokens the model accepted.", "num_accepted_tokens"),
            ("conveyor_spec_decode_verifications", "Request-steps that verified proposals.", "num_verifications"),
        )
        for name, doc, field in totals:
            family = CounterMetricFamily(name, doc, labels=["model"])
            if spec is not None:
                family.add_metric([model], float(getattr(spec, field)))
            yield family
        per_position = (
            ("conveyor_spec_decode_proposed_tokens_by_position", "Tokens proposed at each proposal position "
             "(0: the first after the last accepted token).", "proposed_per_position"),
            ("conveyor_spec_decode_accepted_tokens_by_position", "Proposed tokens accepted, by proposal position.",
             "accepted_per_position"),
        )  # fmt: skip
        for name, doc, field in per_position:
            family = CounterMetricFamily(name, doc, labels=["model", "position"])
            if spec is not None:
                for position, count in enumerate(getattr(spec, field)):
                    family.add_metric([model, str(position)], float(count))
            yield family
