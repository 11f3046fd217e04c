"""``/v1/score`` requests and responses, in vLLM's shape.

A body's ``text_1`` and ``text_2`` are each a string or a non-empty list of strings: one
``text_1`` is scored against every ``text_2`` (1:N), two lists of one length pair up (N:N);
at most ``InputLimits.max_score_pairs`` pairs, each text at most
``InputLimits.max_score_text_chars`` characters. ``model`` and ``user`` are accepted and not
used. The response is vLLM's ``list`` of ``score`` objects, by pair index, with ``usage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.worker.batchio.body_errors import InvalidRequest, shown
from conveyor.worker.core.limits import InputLimits

SCORE = "/v1/score"
_BODY_KEYS = {"model", "text_1", "text_2", "user"}
# What the engine is asked for: a score from the model's scoring head (``PoolingParams``).
SCORE_SAMPLING: dict[str, Any] = {"pooling": {"task": "score"}}


def check_unknown(body: Mapping[str, Any], allowed: set[str], endpoint: str) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise InvalidRequest("unknown_parameter", f"unknown parameter {extra[0]!r} for {endpoint}", extra[0])
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("invalid_value", f"user must be a string, got {shown(user)}", "user")


def score_text(value: Any, where: str, param: str, limits: InputLimits) -> str:
    """One text of a pair, checked: a non-empty string of valid Unicode within the limit."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest("invalid_value", f"{where} must be a non-empty string, got {shown(value)}", param)
    if len(value) > limits.max_score_text_chars:
        raise InvalidRequest(
            "invalid_value", f"{where} has {len(value)} characters; at most {limits.max_score_text_chars}", param
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        why = f"{where} has a lone surrogate; text must be valid Unicode"
        raise InvalidRequest("invalid_value", why, param) from None
    return value


def _texts(body: Mapping[str, Any], param: str, limits: InputLimits) -> list[str]:
    if param not in body:
        raise InvalidRequest("missing_prompt", f"a score request needs {param}", param)
    value = body[param]
    if isinstance(value, str):
        return [score_text(value, param, param, limits)]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "invalid_value", f"{param} must be a string or a non-empty list of strings, got {shown(value)}", param
        )
    if len(value) > limits.max_score_pairs:
        why = f"{param} has {len(value)} texts; at most {limits.max_score_pairs}"
        raise InvalidRequest("invalid_value", why, param)
    return [score_text(v, f"{param}[{i}]", param, limits) for i, v in enumerate(value)]


def parse_score_body(body: Mapping[str, Any], limits: InputLimits, *, strict: bool = True) -> list[list[str]]:
    """The ``[text_1, text_2]`` pairs of a score body. ``strict``: unknown fields are errors."""
    if strict:
        check_unknown(body, _BODY_KEYS, SCORE)
    firsts, seconds = _texts(body, "text_1", limits), _texts(body, "text_2", limits)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidRequest(
            "invalid_value",
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as text_2",
            "text_1",
        )
    return [[a, b] for a, b in zip(firsts, seconds, strict=True)]


def score_response(
    scores: list[float], *, response_id: str, created: int, model: str, prompt_tokens: int
) -> dict[str, Any]:
    """vLLM's ``ScoreResponse`` body."""
    return {
        "id": response_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }
