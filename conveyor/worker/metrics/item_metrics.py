"""Counters and histograms of the items a worker process stores, fed by the execution layer's
item listener (``WorkerContext.item_listeners``): each item once, when its commit succeeds.

Token counters add up the ``usage`` of the stored items, so over a job they equal the job's
``usage``; latencies are the engine's per-request timings (``conveyor.engine.RequestMetrics``), for
the items that have them (a failed item has none; a one-token output has no TPOT).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from conveyor.worker.batchio.output_lines import UNRUN_CODES
from conveyor.worker.metrics import buckets
from conveyor.worker.store.items import ItemRecord
from conveyor.worker.store.models import ItemStatus

# The error codes a worker gives a failed item (``execution/item_records.py``,
# ``execution/shard_runner.py``), and those of the requests a stopped job left unrun
# (``jobs/unrun_items.py``); anything else is counted as ``other``.
ERROR_CODES = (
    "invalid_request",
    "invalid_value",
    "prompt_too_long",
    "grammar_too_complex",
    "engine_error",
    "aborted",
    "shard_failed",
    "worker_crashed",
    *UNRUN_CODES,
)


class ItemMetrics:
    """The item metrics of one model, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        labels = ["model"]
        self.items = Counter(
            "conveyor_items", "Items (requests) stored, by outcome.", ["model", "status"], registry=registry
        )
        self.errors = Counter(
            "conveyor_item_errors", "Failed items stored, by error code.", ["model", "code"], registry=registry
        )
        self.prompt_tokens = Counter(
            "conveyor_prompt_tokens", "Prompt tokens of stored items (usage.prompt_tokens).", labels, registry=registry
        )
        self.cached_tokens = Counter(
            "conveyor_cached_prompt_tokens",
            "Prompt tokens of stored items served from the prefix cache (usage.prompt_tokens_details.cached_tokens).",
            labels,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "conveyor_generation_tokens",
            "Generated tokens of stored items (usage.completion_tokens).",
            labels,
            registry=registry,
        )
        self.ttft = Histogram(
            "conveyor_time_to_first_token_seconds",
            "Time from a request's arrival in the engine to its first token.",
            labels,
            buckets=buckets.TIME_TO_FIRST_TOKEN,
            registry=registry,
        )
        self.tpot = Histogram(
            "conveyor_time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first.",
            labels,
            buckets=buckets.TIME_PER_OUTPUT_TOKEN,
            registry=registry,
        )
        self.queue_time = Histogram(
            "conveyor_request_queue_time_seconds",
            "Time a request waited in the engine before it was first scheduled.",
            labels,
            buckets=buckets.REQUEST_LATENCY,
            registry=registry,
        )
        self.e2e = Histogram(
            "conveyor_e2e_request_latency_seconds",
            "Time from a request's arrival in the engine to its last token.",
            labels,
            buckets=buckets.REQUEST_LATENCY,
            registry=registry,
        )
        # Every series exists from the start (at 0), so rate() and absent() work at once.
        for status in ItemStatus:
            self.items.labels(model, status.value)
        for code in (*ERROR_CODES, "other"):
            self.errors.labels(model, code)
        for metric in (self.prompt_tokens, self.cached_tokens, self.generation_tokens):
            metric.labels(model)
        for histogram in (self.ttft, self.tpot, self.queue_time, self.e2e):
            histogram.labels(model)

    def observe(self, records: Sequence[ItemRecord]) -> None:
        """Count newly stored items (an ``ItemListener``)."""
        m = self.model
        for record in records:
            status = ItemStatus(record.status)
            self.items.labels(m, status.value).inc()
            if status is ItemStatus.failed:
                code = (record.error or {}).get("code")
                self.errors.labels(m, code if code in ERROR_CODES else "other").inc()
            if record.prompt_tokens:
                self.prompt_tokens.labels(m).inc(record.prompt_tokens)
            if record.cached_tokens:
                self.cached_tokens.labels(m).inc(record.cached_tokens)
            if record.completion_tokens:
                self.generation_tokens.labels(m).inc(record.completion_tokens)
            for histogram, value in (
                (self.ttft, record.ttft),
                (self.tpot, record.tpot),
                (self.queue_time, record.queue_time),
                (self.e2e, record.e2e),
            ):
                if value is not None:
                    histogram.labels(m).observe(value)
