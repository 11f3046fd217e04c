"""A request's state machine and its tokens.

WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (blocks freed, back in the waiting
queue, its tokens so far recomputed on re-admission) -> RUNNING ...
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from conveyor.engine.outputs import RequestMetrics
from conveyor.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from conveyor.engine.core.detokenizer import IncrementalDetokenizer
    from conveyor.engine.pooling.pooling_state import PoolingState
    from conveyor.engine.structured.structured_outputs import Constraint


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


class Request:
    """One sequence being generated. ``token_ids`` is prompt + output so far."""

    __slots__ = (
        "arrival_seq",
        "bias_tensors",
        "block_hashes",
        "deadline",
        "detokenizer",
        "error",
        "final_text",
        "generator",
        "grammar",
        "index",
        "logprobs",
        "max_total_tokens",
        "metrics",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_emitted_tokens",
        "num_lookahead_tokens",
        "num_prompt_tokens",
        "output_token_ids",
        "params",
        "pooling",
        "priority",
        "prompt_logprobs",
        "prompt_text",
        "prompt_token_ids",
        "request_id",
        "seq_id",
        "spec_token_ids",
        "status",
        "stop_ids",
        "stop_reason",
        "suppress_ids",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_total_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_seq: int,
        request_id: str | None = None,
        index: int = 0,
        priority: int = 0,
        deadline: float | None = None,
        arrival_time: float | None = None,
        generator: torch.Generator | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
        prompt_text: str | None = None,
        grammar: Constraint | None = None,
        pooling: PoolingState | None = None,
    ) -> None:
        # The engine's own id for this sequence (unique, one per sample of an ``n > 1``
        # request), and the caller's id that its outputs carry (shared by those samples).
        self.seq_id = seq_id
        self.request_id = request_id if request_id is not None else seq_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text = prompt_text
        self.params = params
        self.priority = priority
        self.deadline = deadline  # wall-clock epoch seconds; the ``edf`` and ``priority`` policies order by it
        self.arrival_seq = arrival_seq
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_emitted_tokens = 0
        limit = max_total_tokens
        if params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + params.max_tokens)
        self.max_total_tokens = limit
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= eos_token_ids
        self.stop_ids = frozenset(stop_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            num_prompt_tokens=self.num_prompt_tokens,
        )
        self.generator = generator
        self.detokenizer = detokenizer  # None: the text is decoded once, when finished
        self.final_text: str | None = None
        # The structured-output matcher (or a thinking request's ``ThinkingGate``), fed every kept token.
        self.grammar = grammar
        self.pooling = pooling  # an embedding request's pooling and vector (``conveyor.engine.pooling.pooler``)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # One entry per prompt token as they are computed (the first token has none: None).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        # Chained hashes of this request's full KV blocks, filled lazily by the KV cache.
        self.block_hashes: list[bytes] = []
        # The sampler's device tensors for logit_bias (ids, values) and for the ids that
        # min_tokens masks, built on first use and kept for the request's life.
        self.bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self.suppress_ids: torch.Tensor | None = None
        # Speculative decoding: how many proposed tokens the scheduler may add to this step's
        # decode (set each step before scheduling), and the proposals being verified this step
        # (never part of ``token_ids``: only verified tokens are, so only they are ever hashed).
        self.num_lookahead_tokens = 0
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt tokens whose logprobs were asked for and are not computed yet."""
        if self.prompt_logprobs is None:
            return 0
        return self.num_prompt_tokens - len(self.prompt_logprobs)

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether each prompt token's final hidden state is still to be read (prompt logprobs
        owed, or pooling over more than the last token): none may come from the prefix cache."""
        return bool(self.num_prompt_logprobs_missing) or (
            self.pooling is not None and self.pooling.params.needs_every_row
        )

    @property
    def embedding(self) -> list[float] | None:
        """An embedding request's vector, once its prompt is computed."""
        return self.pooling.embedding if self.pooling is not None else None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def append_output(self, token_id: int, logprobs: dict[int, float] | None, now: float) -> RequestStatus | None:
        """Append one generated token with what goes with it (its logprobs, the metrics, the
        grammar and the detokenizer); the finished state it puts the request in, if any."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        metrics = self.metrics
        metrics.num_generated_tokens += 1
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
        status = self.check_stop(token_id)
        if self.grammar is not None and self.grammar.accept(token_id) and status is None:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        stop_str = self.detokenizer.add(token_id) if self.detokenizer is not None else None
        if stop_str is not None:
            status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = stop_str
        return status

    def scheduled_token_ids(self, start: int, num_new: int) -> list[int]:
        """The tokens a step computes from position ``start``: verified tokens, then any
        proposals under verification."""
        tokens = self.token_ids[start : start + num_new]
        if len(tokens) < num_new:
            tokens += self.spec_token_ids[: num_new - len(tokens)]
        return tokens

    @property
    def below_min_tokens(self) -> bool:
        """Whether the next token is still one that ``min_tokens`` keeps from stopping."""
        return len(self.output_token_ids) < self.params.min_tokens

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """The finished state this new token puts the request in, if any. (A stop token id
        within the first ``min_tokens`` cannot be sampled; it would not stop there either.)"""
        if token_id in self.stop_ids and len(self.output_token_ids) > self.params.min_tokens:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if len(self.token_ids) >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
