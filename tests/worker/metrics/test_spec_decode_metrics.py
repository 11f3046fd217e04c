"""Speculative decoding on a worker's ``/metrics``: the engine's proposal and acceptance counts,
as ``prometheus_client``'s own parser reads the exposition; no samples when it is off."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

from conveyor.engine import LLM, SamplingParams
from conveyor.worker.execution.engine_host import HostStats
from conveyor.worker.metrics.engine_collector import EngineCollector
from tests.worker.helpers import Scrape

PROMPTS = ["one two three one two three one two three one two", "soup bread soup bread soup bread soup"]


def collect(stats: object) -> Scrape:
    """What the engine collector exposes for these engine stats, parsed as a scrape would be."""
    host = HostStats(engine=stats, live_requests=0, submitted=0, finished=0, updated_at=time.time())
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: host, "tiny"))
    return Scrape.parse(generate_latest(registry).decode())


def test_proposals_and_acceptances_by_position(tiny_models) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    looping = tiny_models("llama", init_std=0.02)  # small weights: a random model that repeats itself
    llm = LLM(looping, device="cpu", dtype="float32", speculative_config=spec)
    llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.spec_decode is not None and stats.spec_decode.num_proposed_tokens > 0
    got = collect(stats)
    assert (
        got.value("conveyor_spec_decode_proposed_tokens_total", model="tiny") == stats.spec_decode.num_proposed_tokens
    )
    assert (
        got.value("conveyor_spec_decode_accepted_tokens_total", model="tiny") == stats.spec_decode.num_accepted_tokens
    )
    assert got.value("conveyor_spec_decode_verifications_total", model="tiny") == stats.spec_decode.num_verifications
    for position in range(3):
        labels = {"model": "tiny", "position": str(position)}
        proposed = got.value("conveyor_spec_decode_proposed_tokens_by_position_total", **labels)
        accepted = got.value("conveyor_spec_decode_accepted_tokens_by_position_total", **labels)
        assert (proposed, accepted) == (
            stats.spec_decode.proposed_per_position[position],
            stats.spec_decode.accepted_per_position[position],
        )
    assert (
        sum(s.value for s in got.find("conveyor_spec_decode_accepted_tokens_by_position_total"))
        == stats.spec_decode.num_accepted_tokens
    )


def test_without_speculation_the_families_have_no_samples(tiny_model) -> None:
    llm = LLM(tiny_model, device="cpu", dtype="float32")
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0))
    got = collect(llm.engine.stats())
    assert not [s.name for s in got.samples if s.name.startswith("conveyor_spec_decode")]
    assert got.value("conveyor_engine_steps_total", model="tiny") > 0
