"""``/v1/score`` and ``/v1/rerank`` bodies: vLLM's and Cohere's shapes read into pairs, each
malformed body refused naming the field, the limits on pairs and text lengths, and the
rerank response's order and ``top_n``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from conveyor.worker.batchio.body_errors import InvalidRequest
from conveyor.worker.batchio.rerank_body import RerankOptions, parse_rerank_body, rerank_response
from conveyor.worker.batchio.score_body import parse_score_body
from conveyor.worker.core.limits import DEFAULT_LIMITS

SMALL = replace(DEFAULT_LIMITS, max_score_pairs=3, max_score_text_chars=10)


def test_score_pairs_one_to_many_and_many_to_many() -> None:
    assert parse_score_body({"text_1": "q", "text_2": ["a", "b"]}, SMALL) == [["q", "a"], ["q", "b"]]
    assert parse_score_body({"text_1": ["q"], "text_2": "a"}, SMALL) == [["q", "a"]]
    assert parse_score_body({"text_1": ["p", "q"], "text_2": ["a", "b"]}, SMALL) == [["p", "a"], ["q", "b"]]


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"text_2": "a"}, "text_1", "needs text_1"),
        ({"text_1": "q", "text_2": []}, "text_2", "non-empty list"),
        ({"text_1": "q", "text_2": ["a", 3]}, "text_2", r"text_2\[1\] must be a non-empty string"),
        ({"text_1": "q", "text_2": ["a", ""]}, "text_2", r"text_2\[1\] must be a non-empty string"),
        ({"text_1": ["p", "q"], "text_2": ["a", "b", "c"]}, "text_1", "text_1 has 2 texts and text_2 3"),
        ({"text_1": "q", "text_2": ["a"] * 4}, "text_2", "text_2 has 4 texts; at most 3"),
        ({"text_1": "q" * 11, "text_2": "a"}, "text_1", "text_1 has 11 characters; at most 10"),
        ({"text_1": "q\ud800", "text_2": "a"}, "text_1", "lone surrogate"),
        ({"text_1": "q", "text_2": "a", "truncate": 3}, "truncate", "unknown parameter 'truncate'"),
    ],
)
def test_malformed_score_bodies_are_refused_naming_the_field(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        parse_score_body(body, SMALL)
    assert caught.value.param == param


def test_rerank_bodies() -> None:
    pairs, options = parse_rerank_body({"query": "q", "documents": ["a", {"text": "b"}]}, SMALL)
    assert pairs == [["q", "a"], ["q", "b"]] and options == RerankOptions(top_n=0, return_documents=True)
    _, options = parse_rerank_body({"query": "q", "documents": ["a"], "top_n": 1, "return_documents": False}, SMALL)
    assert options == RerankOptions(top_n=1, return_documents=False)
    for body, message in (
        ({"documents": ["a"]}, "needs a query"),
        ({"query": "q"}, "documents must be a non-empty list"),
        ({"query": "q", "documents": ["a"] * 4}, "documents has 4 entries; at most 3"),
        ({"query": "q", "documents": [{"text": "a", "title": "t"}]}, r"documents\[0\] must be a non-empty string"),
        ({"query": "q", "documents": ["a"], "top_n": True}, "top_n must be a non-negative integer"),
        ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents must be a boolean"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            parse_rerank_body(body, SMALL)


def test_rerank_results_sort_by_score_ties_by_index_and_keep_top_n() -> None:
    body = rerank_response(
        [0.2, 0.9, 0.2, 0.5], ["a", "b", "c", "d"], RerankOptions(3, True), response_id="r", model="m", prompt_tokens=7
    )
    assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(1, "b"), (3, "d"), (0, "a")]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
