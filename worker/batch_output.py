"""OpenAI Batch output lines: the results file (``output_line``) and the errors file
(``error_line``), plus the ``chat.completion`` / ``text_completion`` bodies inside them.

Ids are deterministic (``stable_id``): a redelivered shard writes byte-identical lines.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from worker.request_body import CHAT, COMPLETIONS, ENDPOINTS


@dataclass(frozen=True)
class Choice:
    """One generated sample. ``logprobs`` is already in the endpoint's OpenAI shape."""

    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


def stable_id(prefix: str, *parts: str) -> str:
    """A deterministic id (same inputs, same id): redelivery writes identical lines."""
    return prefix + hashlib.blake2b("\x1f".join(parts).encode("utf-8"), digest_size=12).hexdigest()


def response_body(
    endpoint: str,
    *,
    response_id: str,
    model: str,
    created: int,
    choices: list[Choice],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` object with ``usage``."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if endpoint == CHAT:
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": usage,
        }
    if endpoint == COMPLETIONS:
        return {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                for i, c in enumerate(choices)
            ],
            "usage": usage,
        }
    raise ValueError(f"unknown endpoint {endpoint!r}; expected one of {', '.join(ENDPOINTS)}")


def output_line(job_id: str, custom_id: str, body: dict[str, Any], status_code: int = 200) -> dict[str, Any]:
    """A results-file line: ``{id, custom_id, response: {status_code, request_id, body}, error}``."""
    return {
        "id": stable_id("batch_req_", job_id, custom_id),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": stable_id("req_", job_id, custom_id), "body": body},
        "error": None,
    }


def error_line(
    job_id: str,
    custom_id: str | None,
    *,
    code: str,
    message: str,
    line: int | None = None,
    param: str | None = None,
    status_code: int | None = None,
) -> dict[str, Any]:
    """An errors-file line. ``error`` always holds ``{code, message, param, line}``; with a
    ``status_code`` (a request that ran and failed) ``response`` carries an OpenAI error body."""
    key = custom_id if custom_id is not None else f"line-{line}"
    response = None
    if status_code is not None:
        response = {
            "status_code": status_code,
            "request_id": stable_id("req_", job_id, key),
            "body": {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
        }
    return {
        "id": stable_id("batch_req_", job_id, key, str(line)),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message, "param": param, "line": line},
    }


def dumps_line(obj: Any) -> bytes:
    """One JSONL line: compact, UTF-8, newline-terminated (text that cannot be UTF-8, such
    as a lone surrogate from a ``\\ud800`` escape in the input, is written escaped)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii") + b"\n"
