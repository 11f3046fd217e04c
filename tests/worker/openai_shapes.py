"""OpenAI's documented shapes of output lines (no SDK type exists for them), checked strictly."""

from __future__ import annotations

import base64
import copy
import json
import struct
from typing import Any

from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class OutputResponse(_Strict):
    status_code: int
    request_id: str
    body: dict[str, Any]


class OutputError(_Strict):
    code: str
    message: str
    # Beyond OpenAI's two fields: the same two a BatchError adds (where the line was rejected).
    param: str | None
    line: int


class BatchRequestOutput(_Strict):
    """One line of a results or errors file, as OpenAI documents it (no SDK type exists)."""

    id: str
    custom_id: str
    response: OutputResponse | None
    error: OutputError | None


class _ScoreData(_Strict):
    index: int
    object: str
    score: float


class _ScoreUsage(_Strict):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int


class ScoreResponse(_Strict):
    """vLLM's ``/v1/score`` response (no OpenAI type exists)."""

    id: str
    object: str
    created: int
    model: str
    data: list[_ScoreData]
    usage: _ScoreUsage


class _RerankDocument(_Strict):
    text: str


class _RerankResult(_Strict):
    index: int
    document: _RerankDocument | None = None
    relevance_score: float


class _RerankUsage(_Strict):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(_Strict):
    """vLLM's (Cohere/Jina's) ``/v1/rerank`` response."""

    id: str
    model: str
    usage: _RerankUsage
    results: list[_RerankResult]


def _score_kind(body: dict[str, Any]) -> type[BaseModel] | None:
    """vLLM's score or rerank response type for ``body``, or None for OpenAI's bodies."""
    if "results" in body and "object" not in body:
        return RerankResponse
    data = body.get("data")
    if body.get("object") == "list" and isinstance(data, list) and data and data[0].get("object") == "score":
        return ScoreResponse
    return None


def _echoed_first_token_filled(body: dict[str, Any]) -> dict[str, Any]:
    """A completion's body with the echoed prompt's first token given a logprob. OpenAI (and
    vLLM) send null there, as nothing predicts a text's first token, but the SDK's type has
    no room for it: only that place may be null, and it is checked as such here."""
    if body.get("object") != "text_completion":
        return body
    body = copy.deepcopy(body)
    for choice in body["choices"]:
        lp = choice.get("logprobs")
        if lp and lp.get("token_logprobs") and lp["token_logprobs"][0] is None:
            assert lp["top_logprobs"][0] is None, "the first token has no alternatives either"
            lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
    return body


def _base64_vectors_decoded(body: dict[str, Any]) -> dict[str, Any]:
    """An embeddings body with its base64 vectors (``encoding_format: base64``) decoded as the
    SDK decodes them (little-endian float32): its type holds lists of floats only."""
    if body.get("object") != "list" or not any(isinstance(d.get("embedding"), str) for d in body["data"]):
        return body
    body = copy.deepcopy(body)
    for item in body["data"]:
        raw = base64.b64decode(item["embedding"], validate=True)
        assert len(raw) % 4 == 0
        item["embedding"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return body


def check_output_line(data: str, *, results: bool) -> BatchRequestOutput:
    """A line as OpenAI writes one: a response (its body typed by the SDK) or an error, never both."""
    line = BatchRequestOutput.model_validate(json.loads(data))
    assert line.id.startswith("batch_req_") and line.custom_id
    assert (line.response is None) != (line.error is None), data
    if line.response is not None:
        response = line.response
        assert response.request_id.startswith("req_")
        if results:
            assert response.status_code == 200
            kinds: dict[str, type[BaseModel]] = {
                "chat.completion": ChatCompletion,
                "response": Response,
                "list": CreateEmbeddingResponse,
            }
            kind = _score_kind(response.body) or kinds.get(response.body["object"], Completion)
            kind.model_validate(_base64_vectors_decoded(_echoed_first_token_filled(response.body)), strict=True)
        else:
            # A request that got an HTTP error: OpenAI's error body, typed for its status.
            assert 400 <= response.status_code < 600 and response.body.keys() == {"error"}
            assert response.body["error"].keys() == {"message", "type", "param", "code"}
            error = ErrorObject.model_validate(response.body["error"], strict=True)
            expected = "invalid_request_error" if response.status_code < 500 else "server_error"
            assert error.type == expected and error.code and error.message
    else:
        assert not results  # a request that could not run at all only appears in the errors file
    return line
