"""What one executed step hands back to the scheduler: the tokens each request produced and
how long it took. The runner fills it; ``Scheduler.update_from_output`` is the
only reader that changes a request's state from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.core.request import Request


@dataclass(slots=True)
class NewTokens:
    """The tokens one request produced this step beyond a single sampled one: (speculative
    decoding) the proposals the target accepted followed by its own token."""

    req: Request
    token_ids: list[int]
    # One entry per token when the request asked for logprobs; None otherwise.
    logprobs: list[dict[int, float] | None] | None = None
    # Proposed tokens computed this step that the target rejected: their K/V is stale.
    num_rejected: int = 0


@dataclass
class StepResult:
    # The requests that sampled one token this step, in batch order, and the tokens (with
    # their logprobs, per request that asked) as the sampler gave them.
    sampled: list[Request] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[dict[int, float] | None] | None = None
    # Requests that produced several tokens (speculative decoding's verified proposals).
    new_tokens: list[NewTokens] = field(default_factory=list)
    # Seconds from the start of scheduling to the end of the forward pass and sampling.
    duration_s: float = 0.0

    @property
    def requests(self) -> list[Request]:
        """Every request that produced tokens, in the order their outputs are reported."""
        return self.sampled + [new.req for new in self.new_tokens] if self.new_tokens else self.sampled
