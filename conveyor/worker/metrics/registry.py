"""A fresh ``CollectorRegistry`` per metrics endpoint, never the global default one: two apps
in one process (tests, a client beside a worker) keep their metrics apart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector


def new_registry() -> CollectorRegistry:
    """A registry with what the default one holds: the process (CPU, memory, file
    descriptors), platform (Python version) and garbage-collector collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
