"""The settings that bound one job's input and requests."""

from __future__ import annotations

from pydantic import BaseModel, Field

from conveyor.worker.core.limits import DEFAULT_LIMITS, MAX_CUSTOM_ID_CHARS, InputLimits


class JobLimitSettings(BaseModel):
    """Job limits.

    Limits on user-provided sizes and counts: one job's input, each of its requests, and what a
    submitter may ask for.
    """

    # Limits on user-provided sizes and counts (defaults in ``conveyor.worker.core.limits``; these fields
    # only add the bounds an operator may set).

    # The largest input file a job may have, in bytes (a bigger one fails the job as a whole).
    max_input_bytes: int = Field(DEFAULT_LIMITS.max_input_bytes, ge=1)
    # The most lines (requests) one job's input may hold.
    max_lines_per_job: int = Field(DEFAULT_LIMITS.max_lines, ge=1)
    # The longest input line, in bytes; a longer one is that line's error.
    max_line_bytes: int = Field(DEFAULT_LIMITS.max_line_bytes, ge=64)
    # The longest ``custom_id``, in characters (at most the database column's 512).
    max_custom_id_chars: int = Field(DEFAULT_LIMITS.max_custom_id_chars, ge=1, le=MAX_CUSTOM_ID_CHARS)
    # The largest ``max_tokens`` (or ``max_completion_tokens``) a request may ask for.
    max_tokens: int = Field(DEFAULT_LIMITS.max_tokens, ge=1)
    # The ``max_tokens`` of a request that names none (at most ``max_tokens``).
    default_max_tokens: int = Field(DEFAULT_LIMITS.default_max_tokens, ge=1)
    # The largest ``n`` (samples per request).
    max_n: int = Field(DEFAULT_LIMITS.max_n, ge=1, le=64)
    # The largest ``logprobs``/``top_logprobs`` (alternatives per token).
    max_logprobs: int = Field(DEFAULT_LIMITS.max_logprobs, ge=0, le=20)
    # The most ``stop`` strings per request (OpenAI allows 4).
    max_stop_sequences: int = Field(DEFAULT_LIMITS.max_stop_sequences, ge=0, le=32)
    # The most ``stop_token_ids`` per request.
    max_stop_token_ids: int = Field(DEFAULT_LIMITS.max_stop_token_ids, ge=0, le=1024)
    # The most ``logit_bias`` entries per request.
    max_logit_bias: int = Field(DEFAULT_LIMITS.max_logit_bias, ge=0, le=1024)
    # The most chat ``messages`` per request.
    max_messages: int = Field(DEFAULT_LIMITS.max_messages, ge=1)
    # The largest shard a submitter may ask for (``--shard-size``), in requests.
    max_shard_size: int = Field(10_000, ge=1)
    # The largest job ``priority`` a submitter may give (lower runs first).
    max_priority: int = Field(1000, ge=0)

    def input_limits(self) -> InputLimits:
        return InputLimits(
            max_input_bytes=self.max_input_bytes,
            max_lines=self.max_lines_per_job,
            max_line_bytes=self.max_line_bytes,
            max_custom_id_chars=self.max_custom_id_chars,
            max_tokens=self.max_tokens,
            default_max_tokens=self.default_max_tokens,
            max_n=self.max_n,
            max_logprobs=self.max_logprobs,
            max_stop_sequences=self.max_stop_sequences,
            max_stop_token_ids=self.max_stop_token_ids,
            max_logit_bias=self.max_logit_bias,
            max_messages=self.max_messages,
        )
