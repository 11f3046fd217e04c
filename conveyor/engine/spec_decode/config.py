"""``SpeculativeConfig``: which proposer, how many tokens, validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft")
# More proposals than this per step cost more target compute than even a perfect acceptance
# rate pays back, and make every verification query long.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method="ngram"``: prompt lookup, the last ``prompt_lookup_max``..``prompt_lookup_min``
    tokens matched against the request's earlier tokens, the tokens that followed proposed.
    ``method="draft"``: ``model`` (same tokenizer as the target) proposes greedily.
    Either way up to ``num_speculative_tokens`` tokens per request and step are verified by
    one target forward pass."""

    # How proposals are made: ``ngram`` (prompt lookup) or ``draft`` (a smaller model).
    method: str
    # Tokens proposed per request and step, all verified by one target forward pass.
    num_speculative_tokens: int = 4
    # Prompt lookup: the shortest suffix of the request's tokens matched against its earlier ones.
    prompt_lookup_min: int = 1
    # Prompt lookup: the longest suffix matched (tried first).
    prompt_lookup_max: int = 4
    # The draft checkpoint (``method="draft"``), with the target's tokenizer.
    model: str | None = None
    # The draft checkpoint's revision on the hub.
    revision: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft" and (not isinstance(self.model, str) or not self.model):
            raise ValueError("speculative_config.model (the draft checkpoint) is required with method='draft'")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is for method='draft'; ngram needs no model")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        """A config from itself or from a dict (``LLM(speculative_config={...})``, JSON engine args)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method', one of {SPEC_METHODS}")
        return cls(**value)
