"""OpenAI ``/v1/embeddings`` requests and responses.

A body's ``input`` is a string, a list of strings, a list of token ids or a list of lists of
token ids (at most ``InputLimits.max_embedding_inputs`` of them, OpenAI's 2,048); ``dimensions``
truncates each vector (re-normalised when the model normalises); ``encoding_format`` is
``float`` (lists of numbers) or ``base64`` (little-endian float32 bytes, as OpenAI sends
them); ``model`` and ``user`` are accepted and not used. The response body is OpenAI's
``list`` of ``embedding`` objects with ``usage``.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping
from typing import Any

from conveyor.worker.batchio.body_errors import InvalidRequest, shown
from conveyor.worker.core.limits import InputLimits

EMBEDDINGS = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")
_BODY_KEYS = {"input", "model", "dimensions", "encoding_format", "user"}

EmbeddingInput = str | list[int]


def parse_embeddings_body(
    body: Mapping[str, Any], limits: InputLimits, *, strict: bool
) -> tuple[list[EmbeddingInput], dict[str, Any], str]:
    """The inputs, the ``SamplingParams`` kwargs (``pooling``) and the encoding format of an
    embeddings body. ``strict``: unknown fields are errors (batch lines), else ignored (plain rows)."""
    if strict:
        extra = sorted(set(body) - _BODY_KEYS)
        if extra:
            raise InvalidRequest("unknown_parameter", f"unknown parameter {extra[0]!r} for {EMBEDDINGS}", extra[0])
    if "input" not in body:
        raise InvalidRequest("missing_prompt", "an embeddings request needs input", "input")
    inputs = parse_input(body["input"], limits)
    pooling: dict[str, Any] = {}
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= 65_536:
            raise InvalidRequest("invalid_value", f"dimensions must be a positive integer, got {shown(dimensions)}")
        pooling["dimensions"] = dimensions
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise InvalidRequest(
            "invalid_value", f"encoding_format must be float or base64, got {shown(encoding)}", "encoding_format"
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("invalid_value", f"user must be a string, got {shown(user)}", "user")
    return inputs, {"pooling": pooling}, encoding


def parse_input(value: Any, limits: InputLimits) -> list[EmbeddingInput]:
    if isinstance(value, str):
        return [_one_text(value, 0)]
    if not isinstance(value, list) or not value:
        raise _bad_input(value)
    if all(_is_token_id(t) for t in value):
        return [_token_ids(value, 0)]
    if len(value) > limits.max_embedding_inputs:
        raise InvalidRequest(
            "invalid_value", f"input has {len(value)} entries; at most {limits.max_embedding_inputs}", "input"
        )
    out: list[EmbeddingInput] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(_one_text(item, i))
        elif isinstance(item, list) and item and all(_is_token_id(t) for t in item):
            out.append(_token_ids(item, i))
        else:
            raise _bad_input(item, f"input[{i}]")
    return out


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_text(text: str, index: int) -> str:
    if not text:
        raise InvalidRequest("invalid_value", f"input[{index}] is empty", "input")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            "invalid_value", f"input[{index}] has a lone surrogate; text must be valid Unicode", "input"
        ) from None
    return text


def _token_ids(ids: list[int], index: int) -> list[int]:
    if min(ids) < 0:
        raise InvalidRequest("invalid_value", f"input[{index}] has a negative token id", "input")
    return ids


def _bad_input(value: Any, where: str = "input") -> InvalidRequest:
    return InvalidRequest(
        "invalid_value",
        f"{where} must be a non-empty string, a list of strings, a list of token ids or a list of lists of "
        f"token ids, got {shown(value)}",
        "input",
    )


def encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    """A vector as the response carries it: numbers, or base64 of little-endian float32."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embeddings_response(vectors: list[list[float]], *, model: str, encoding: str, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's ``CreateEmbeddingResponse`` body."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding)} for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
