"""OpenAI Batch output lines: the results file (``output_line``) and the errors file, plus the
``chat.completion`` / ``text_completion`` bodies inside them.

Every line is ``{id, custom_id, response, error}`` with exactly one of ``response`` and
``error`` set, as OpenAI writes them:

- ``output_line``: a result, ``response`` with status 200 and the completion as its body.
- ``failed_request_line``: a request that ran and failed. ``response`` holds its HTTP status
  and OpenAI's error body ``{"error": {message, type, param, code}}``. The type is
  ``invalid_request_error`` for a 4xx and ``server_error`` for a 5xx.
- ``error_line`` / ``line_error_line``: a line that could not run at all (rejected at
  validation). ``error`` is ``{code, message, param, line}``: OpenAI's two fields plus the two
  a ``BatchError`` adds. A line with no usable ``custom_id`` (unparseable, say) is named
  ``line-<n>``, as plain rows without an id are.

Ids are deterministic (``stable_id``): a redelivered shard writes byte-identical lines.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from conveyor.worker.batchio.records import LineError
from conveyor.worker.batchio.request_body import CHAT, COMPLETIONS, ENDPOINTS


@dataclass(frozen=True)
class Choice:
    """One generated sample. ``logprobs`` is already in the endpoint's OpenAI shape."""

    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    # A chat answer's tool calls (OpenAI's ``tool_calls``); its content is then ``text`` or null.
    tool_calls: list[dict[str, Any]] | None = None
    # A reasoning model's thinking (the text is then its answer), and how many tokens it took.
    reasoning: str | None = None
    reasoning_tokens: int = 0


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
    reasoning_field: str = "reasoning",
) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` object with ``usage``. A reasoning model's
    thinking goes in each message's ``reasoning_field`` and its tokens in
    ``usage.completion_tokens_details.reasoning_tokens``."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if endpoint == CHAT:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)}
    if endpoint == CHAT:
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "message": _message(c, reasoning_field),
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


def _message(c: Choice, reasoning_field: str = "reasoning") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    if c.reasoning is not None:
        message[reasoning_field] = c.reasoning
    if c.tool_calls:
        message.update(content=c.text or None, tool_calls=c.tool_calls)
    return message


def output_line(job_id: str, custom_id: str, body: dict[str, Any], status_code: int = 200) -> dict[str, Any]:
    """A results-file line: ``{id, custom_id, response: {status_code, request_id, body}, error}``."""
    return {
        "id": stable_id("batch_req_", job_id, custom_id),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": stable_id("req_", job_id, custom_id), "body": body},
        "error": None,
    }


def error_type(status_code: int) -> str:
    """OpenAI's error ``type`` for an HTTP error status."""
    return "server_error" if status_code >= 500 else "invalid_request_error"


def failed_request_line(
    job_id: str,
    custom_id: str,
    *,
    status_code: int,
    code: str,
    message: str,
    line: int,
    param: str | None = None,
) -> dict[str, Any]:
    """An errors-file line for a request that ran and got an HTTP error (4xx or 5xx): the
    error is in ``response`` (OpenAI's error body) and ``error`` is null."""
    return {
        "id": stable_id("batch_req_", job_id, custom_id, str(line)),
        "custom_id": custom_id,
        "response": {
            "status_code": status_code,
            "request_id": stable_id("req_", job_id, custom_id),
            "body": {"error": {"message": message, "type": error_type(status_code), "param": param, "code": code}},
        },
        "error": None,
    }


# OpenAI's code and message for a request its batch's completion window left unrun.
BATCH_EXPIRED = "batch_expired"
BATCH_EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
# A request its batch's cancel left unrun: the same line as an expired one, under its own code.
BATCH_CANCELLED = "batch_cancelled"
BATCH_CANCELLED_MESSAGE = "This request was not executed: its batch was cancelled first."
# The codes of requests that never ran because their batch stopped: ``results --unfinished`` resubmits them.
UNRUN_CODES = (BATCH_EXPIRED, BATCH_CANCELLED)


def error_line(
    job_id: str, custom_id: str | None, *, code: str, message: str, line: int, param: str | None = None
) -> dict[str, Any]:
    """An errors-file line for an input line that could not run at all: ``response`` is null
    and ``error`` says why and where. Without a ``custom_id`` the line is named ``line-<n>``."""
    key = custom_id if custom_id is not None else f"line-{line}"
    return {
        "id": stable_id("batch_req_", job_id, key, str(line)),
        "custom_id": key,
        "response": None,
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


def line_error_line(job_id: str, err: LineError) -> dict[str, Any]:
    """The errors-file line for an input line rejected at validation."""
    return error_line(job_id, err.custom_id, code=err.code, message=err.message, line=err.line, param=err.param)
