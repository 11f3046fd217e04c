"""The groups a worker served last, and the affinity hits its metrics report."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from conveyor.worker.execution.shard_affinity import ShardAffinity
from conveyor.worker.metrics.affinity_collector import AffinityCollector


def test_recent_groups_are_bounded_and_a_repeat_is_a_hit() -> None:
    affinity = ShardAffinity(remember=2)
    assert affinity.serving(None) is False and affinity.recent() == []
    assert affinity.serving("a") is False
    assert affinity.serving("b") is False
    assert affinity.serving("a") is True and affinity.recent() == ["b", "a"]  # most recent last
    assert affinity.serving("c") is False and affinity.recent() == ["a", "c"]  # "b" forgotten
    assert affinity.serving("b") is False
    for hit in (False, True, False):
        affinity.ran(hit)
    registry = CollectorRegistry()
    registry.register(AffinityCollector(affinity, "m"))
    text = generate_latest(registry).decode()
    assert 'conveyor_shard_turns_total{model="m"} 3.0' in text
    assert 'conveyor_shard_affinity_hits_total{model="m"} 1.0' in text
