"""Counters of speculative decoding, as ``EngineStats.spec_decode`` reports them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    method: str
    num_speculative_tokens: int
    num_verifications: int = 0  # request-steps that verified proposals
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    # Per proposal position (0: the first proposed token): how often a token was proposed
    # there, and how often it was accepted.
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.proposed_per_position = self.proposed_per_position or [0] * k
        self.accepted_per_position = self.accepted_per_position or [0] * k

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        pairs = zip(self.accepted_per_position, self.proposed_per_position, strict=True)
        return [a / p if p else 0.0 for a, p in pairs]

    @property
    def mean_accepted_per_verification(self) -> float:
        return self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_verifications += 1
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for j in range(num_proposed):
            self.proposed_per_position[j] += 1
            if j < num_accepted:
                self.accepted_per_position[j] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.method,
            self.num_speculative_tokens,
            self.num_verifications,
            self.num_proposed_tokens,
            self.num_accepted_tokens,
            list(self.proposed_per_position),
            list(self.accepted_per_position),
        )
