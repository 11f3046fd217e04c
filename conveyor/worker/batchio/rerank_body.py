"""``/v1/rerank`` requests and responses, in the Cohere/Jina shape vLLM serves.

A body's ``query`` is a string and ``documents`` a non-empty list of strings (or Cohere's
``{"text": ...}`` objects), at most ``InputLimits.max_score_pairs`` of them; each pair
``[query, document]`` is scored as ``/v1/score`` scores it. ``top_n`` keeps the best ``n``
results (absent or 0: all, as vLLM); ``return_documents`` (default true, as vLLM) puts each
document's text in its result. ``model`` and ``user`` are accepted and not used. The
response's ``results`` are sorted by ``relevance_score``, highest first (ties by index).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.worker.batchio.body_errors import InvalidRequest, shown
from conveyor.worker.batchio.score_body import check_unknown, score_text
from conveyor.worker.core.limits import InputLimits

RERANK = "/v1/rerank"
_BODY_KEYS = {"model", "query", "documents", "top_n", "return_documents", "user"}


@dataclass(frozen=True)
class RerankOptions:
    top_n: int  # 0: every result
    return_documents: bool

    def to_json(self) -> dict[str, Any]:
        return {"top_n": self.top_n, "return_documents": self.return_documents}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RerankOptions:
        return cls(int(data["top_n"]), bool(data["return_documents"]))


def parse_rerank_body(
    body: Mapping[str, Any], limits: InputLimits, *, strict: bool = True
) -> tuple[list[list[str]], RerankOptions]:
    """The ``[query, document]`` pairs of a rerank body, and its options."""
    if strict:
        check_unknown(body, _BODY_KEYS, RERANK)
    if "query" not in body:
        raise InvalidRequest("missing_prompt", "a rerank request needs a query", "query")
    query = score_text(body["query"], "query", "query", limits)
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise InvalidRequest(
            "missing_prompt" if documents is None else "invalid_value",
            f"documents must be a non-empty list of strings, got {shown(documents)}",
            "documents",
        )
    if len(documents) > limits.max_score_pairs:
        raise InvalidRequest(
            "invalid_value", f"documents has {len(documents)} entries; at most {limits.max_score_pairs}", "documents"
        )
    texts = []
    for i, doc in enumerate(documents):
        if isinstance(doc, dict) and set(doc) == {"text"}:
            doc = doc["text"]
        texts.append(score_text(doc, f"documents[{i}]", "documents", limits))
    top_n = body.get("top_n")
    if top_n is None:
        top_n = 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise InvalidRequest("invalid_value", f"top_n must be a non-negative integer, got {shown(top_n)}", "top_n")
    returned = body.get("return_documents", True)
    if returned is None:
        returned = True
    if not isinstance(returned, bool):
        raise InvalidRequest(
            "invalid_value", f"return_documents must be a boolean, got {shown(returned)}", "return_documents"
        )
    return [[query, t] for t in texts], RerankOptions(top_n, returned)


def rerank_response(
    scores: list[float],
    documents: list[str],
    options: RerankOptions,
    *,
    response_id: str,
    model: str,
    prompt_tokens: int,
) -> dict[str, Any]:
    """vLLM's ``RerankResponse`` body: results by score, highest first, ``top_n`` of them."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if options.top_n:
        order = order[: options.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i}
        if options.return_documents:
            result["document"] = {"text": documents[i]}
        result["relevance_score"] = scores[i]
        results.append(result)
    return {
        "id": response_id,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": results,
    }
