"""What the engine hands back: one ``RequestOutput`` per request that advanced in a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps are ``time.monotonic()`` seconds; ``None`` until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: tokens proposed for this request, and of those the target accepted.
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    """State of one request (one sample of it when ``n > 1``: see ``index``) after a step.

    ``token_ids``/``text`` hold everything generated so far; ``new_token_ids``/``new_text``
    the delta of this step. ``logprobs`` has one ``{token_id: logprob}`` dict per generated
    token (the chosen token plus the top alternatives) when the request asked for them;
    ``prompt_logprobs`` one per prompt token (None for the first, which nothing predicts) with
    ``SamplingParams.prompt_logprobs``, complete once the prompt is computed.
    ``finish_reason`` is ``stop``, ``length``, ``abort`` or ``error`` once ``finished``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    metrics: RequestMetrics
    index: int = 0
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None
    prompt: str | None = field(default=None, repr=False)
    # An embedding request's vector (``SamplingParams.pooling``), in its finished output.
    embedding: list[float] | None = field(default=None, repr=False)
    # A score request's relevance score (``PoolingParams(task="score")``), in its finished output.
    score: float | None = None


@dataclass
class EmbeddingOutput:
    """``LLM.embed``'s result for one input: its vector and how many tokens the input was.
    An input the engine rejects has an empty ``embedding`` and the reason in ``error``."""

    embedding: list[float]
    num_prompt_tokens: int
    error: str | None = None


@dataclass
class ScoreOutput:
    """``LLM.score``'s result for one pair: its score and how many tokens the pair's prompt
    was. A pair the engine rejects has ``score`` None and the reason in ``error``."""

    score: float | None
    num_prompt_tokens: int
    error: str | None = None
