"""The webhook attempts a process made, by outcome (``conveyor_webhook_attempts_total``):
``delivered``, ``retrying`` (failed, to be tried again) and ``failed`` (given up). The
deliveries' states across the deployment are the database collector's
``conveyor_webhook_deliveries``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

OUTCOMES = ("delivered", "retrying", "failed")


class WebhookAttempts:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter(
            "conveyor_webhook_attempts",
            "Webhook delivery attempts this process made, by outcome: delivered, retrying (will be tried "
            "again) or failed (given up).",
            labelnames=["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self._counter.labels(outcome)

    def __call__(self, outcome: str) -> None:
        self._counter.labels(outcome).inc()
