"""Bounds on everything a user's input controls: the one place their defaults are defined.

``Settings`` (``CONVEYOR_MAX_*``) lets an operator change them within hard ceilings; the
input readers and request-body validation (``conveyor.worker.batchio``) enforce them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# The width of the ``items.custom_id`` column: fits a Postgres btree key even in 4-byte UTF-8.
MAX_CUSTOM_ID_CHARS = 512

# Integer literals in a JSON line longer than this stay unparsed (no field takes one). Python
# itself refuses str -> int past 4,300 digits, and big ints overflow float fields.
MAX_INTEGER_DIGITS = 100


@dataclass(frozen=True)
class InputLimits:
    """Bounds on everything a user's input file controls (read by ``conveyor.worker.batchio``)."""

    max_input_bytes: int = 512 * MiB
    max_lines: int = 1_000_000
    max_line_bytes: int = 1 * MiB
    max_custom_id_chars: int = MAX_CUSTOM_ID_CHARS
    max_tokens: int = 32_768
    default_max_tokens: int = 256
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_chars: int = 512
    max_stop_token_ids: int = 256
    # logit_bias entries: OpenAI's API reference states no bound; its API refuses more than 300.
    max_logit_bias: int = 300
    max_messages: int = 1024
    max_embedding_inputs: int = 2048  # inputs of one /v1/embeddings line (OpenAI's limit)
    # Pairs of one /v1/score line, documents of one /v1/rerank line (Cohere's limit), and the
    # characters of each text in them (the engine refuses a pair too long for the model).
    max_score_pairs: int = 1000
    max_score_text_chars: int = 256 * KiB
    # Structured outputs and tools: a JSON Schema (response_format, a tool's parameters, all
    # of a request's tools together) as compact JSON, its nesting, a choice's entries, tools.
    max_schema_bytes: int = 64 * KiB
    max_schema_depth: int = 32
    max_choices: int = 256
    max_tools: int = 128
    # Entries of a chat request's chat_template_kwargs.
    max_chat_template_kwargs: int = 32


DEFAULT_LIMITS = InputLimits()

# The HTTP API's Files endpoint: an upload's size (OpenAI's own per-file limit, and the default
# CONVEYOR_MAX_INPUT_BYTES, so an upload that fits can be a batch's input), and its filename.
DEFAULT_MAX_UPLOAD_BYTES = 512 * MiB
MAX_FILENAME_CHARS = 255


# A job's completion window (OpenAI's ``completion_window``): whole hours or days, "1h" to "30d".
DEFAULT_COMPLETION_WINDOW = "24h"
MAX_COMPLETION_WINDOW_HOURS = 30 * 24
# The shortest window; only tests lower it (CONVEYOR_MIN_COMPLETION_WINDOW_SECONDS), which
# also admits windows in seconds ("5s") so that expiry can be seen in seconds, not hours.
MIN_COMPLETION_WINDOW_SECONDS = 3600
_WINDOW = re.compile(r"([1-9][0-9]{0,3})([hd])")
_SECONDS_WINDOW = re.compile(r"([1-9][0-9]{0,3})s")


def completion_window_seconds(window: object, minimum: int = MIN_COMPLETION_WINDOW_SECONDS) -> int:
    """The length of a completion window such as ``"24h"``, ``"1h"`` or ``"7d"``, in seconds;
    ``ValueError`` naming the value for anything else. With ``minimum`` under an hour (tests),
    ``"5s"`` (seconds, at least ``minimum``) is accepted too."""
    if minimum < MIN_COMPLETION_WINDOW_SECONDS and isinstance(window, str):
        short = _SECONDS_WINDOW.fullmatch(window)
        if short is not None and minimum <= int(short[1]) < MIN_COMPLETION_WINDOW_SECONDS:
            return int(short[1])
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    hours = 0 if match is None else int(match[1]) * (24 if match[2] == "d" else 1)
    if not 1 <= hours <= MAX_COMPLETION_WINDOW_HOURS:
        raise ValueError(
            "completion window must be a whole number of hours or days such as '24h' or '7d', "
            f"from 1h to {MAX_COMPLETION_WINDOW_HOURS // 24}d, got {window!r:.40}"
        )
    return hours * 3600
