"""Speculative decoding: proposers (prompt lookup, a draft model), verification, stats."""

from conveyor.engine.spec_decode.config import SpeculativeConfig
from conveyor.engine.spec_decode.stats import SpecDecodeStats

__all__ = ["SpecDecodeStats", "SpeculativeConfig"]
