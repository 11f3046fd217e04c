"""``/v1/score`` and ``/v1/rerank`` batches through ``conveyor run``: vLLM's line shapes in,
vLLM's score and rerank responses out, with scores equal to sentence-transformers'
``CrossEncoder.predict``; a malformed line errors alone; a model without a scoring head
answers each line with the reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.worker.entrypoints.cli import main
from tests.engine.score_checkpoints import build_cross_encoder, build_qwen3_reranker, qwen3_reranker_reference
from tests.engine.shrunk_checkpoint import build_shrunk_checkpoint
from tests.worker.helpers import Stack, make_values, parse_lines
from tests.worker.openai_shapes import RerankResponse, check_output_line

ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16, "dtype": "float32"}
QUERY = "the chef brings hot soup"
DOCUMENTS = ["soup is hot", "tea and cake " * 6, "the guest pays the bill", "a"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    return build_cross_encoder(tmp_path_factory.mktemp("score-run") / "bert", "bert")


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(env, tmp_path: Path, model: str, lines: list[str], capsys, rc: int = 0) -> tuple[list[dict], list[dict]]:
    env(Stack(make_values(tmp_path / "home", model, engine_args=dict(ENGINE)), model))
    path, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["run", str(path), "--model", model, "-o", str(out), "--errors", str(err), "-q"]) == rc, (
        capsys.readouterr().err
    )
    results, errors = out.read_text().splitlines(), err.read_text().splitlines()
    for line in results:
        check_output_line(line, results=True)
    for line in errors:
        check_output_line(line, results=False)
    return parse_lines(results), parse_lines(errors)


def _reference(model: str, pairs: list[list[str]]) -> list[float]:
    from sentence_transformers import CrossEncoder

    return [float(s) for s in CrossEncoder(model, device="cpu").predict(pairs)]


def test_score_lines_equal_the_cross_encoder(cross_encoder, env, tmp_path, capsys) -> None:
    lines = [
        _line("one-to-many", "/v1/score", {"model": "m", "text_1": QUERY, "text_2": DOCUMENTS}),
        _line("pairs", "/v1/score", {"text_1": DOCUMENTS[:2], "text_2": [QUERY, DOCUMENTS[3]]}),
        _line("bad", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
        _line("too-long", "/v1/score", {"text_1": QUERY, "text_2": ["soup", "tea and cake " * 300]}),
    ]
    results, errors = _run(env, tmp_path, cross_encoder, lines, capsys)
    bodies = {r["custom_id"]: r["response"]["body"] for r in results}
    assert set(bodies) == {"one-to-many", "pairs"}
    for custom_id, pairs in (
        ("one-to-many", [[QUERY, d] for d in DOCUMENTS]),
        ("pairs", [[DOCUMENTS[0], QUERY], [DOCUMENTS[1], DOCUMENTS[3]]]),
    ):
        body = bodies[custom_id]
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(pairs)))
        got = torch.tensor([d["score"] for d in body["data"]])
        torch.testing.assert_close(got, torch.tensor(_reference(cross_encoder, pairs)), atol=1e-5, rtol=0)
        assert body["usage"]["prompt_tokens"] > 0
    bad, too_long = sorted(errors, key=lambda e: e["custom_id"])
    assert bad["custom_id"] == "bad" and "text_1 has 2 texts and text_2 3" in bad["error"]["message"]
    message = too_long["response"]["body"]["error"]["message"]
    assert too_long["custom_id"] == "too-long"
    assert message.startswith("pair[1]: prompt is ") and "at most 512" in message


def test_rerank_lines_sort_by_score_and_keep_top_n(cross_encoder, env, tmp_path, capsys) -> None:
    lines = [
        _line("all", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        _line("top2", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}),
        _line("cohere-docs", "/v1/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS[:2]]}),
        _line("bad", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}),
    ]
    results, errors = _run(env, tmp_path, cross_encoder, lines, capsys)
    bodies = {r["custom_id"]: r["response"]["body"] for r in results}
    want = _reference(cross_encoder, [[QUERY, d] for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    everything = bodies["all"]["results"]
    assert [r["index"] for r in everything] == order
    assert [r["document"]["text"] for r in everything] == [DOCUMENTS[i] for i in order]
    got = torch.tensor([r.relevance_score for r in RerankResponse.model_validate(bodies["all"]).results])
    torch.testing.assert_close(got, torch.tensor([want[i] for i in order]), atol=1e-5, rtol=0)
    top = bodies["top2"]["results"]
    assert [r["index"] for r in top] == order[:2] and all("document" not in r for r in top)
    assert [r["document"]["text"] for r in bodies["cohere-docs"]["results"]] != []
    [error] = errors
    assert error["custom_id"] == "bad" and "top_n must be a non-negative integer" in error["error"]["message"]


def test_rerank_lines_with_the_qwen3_reranker_equal_transformers(env, tmp_path, capsys) -> None:
    model, tokens = build_qwen3_reranker(tmp_path / "qwen3-reranker")
    lines = [_line(f"r{i}", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[i:]}) for i in range(2)]
    results, errors = _run(env, tmp_path, model, lines, capsys)
    assert not errors
    want = qwen3_reranker_reference(model, tokens, [(QUERY, d) for d in DOCUMENTS])
    for result in results:
        start = int(result["custom_id"][1:])
        ranked = RerankResponse.model_validate(result["response"]["body"]).results
        assert sorted(r.index for r in ranked) == list(range(len(DOCUMENTS) - start))
        got = torch.tensor([r.relevance_score for r in ranked])
        expected = torch.stack([want[start + r.index] for r in ranked])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert got.tolist() == sorted(got.tolist(), reverse=True)


@pytest.mark.parametrize(
    "url,body",
    [("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[:2]}), ("/v1/rerank", {"query": QUERY, "documents": ["a"]})],
)
def test_a_model_without_a_scoring_head_answers_each_line_with_the_reason(env, tmp_path, capsys, url, body) -> None:
    published = Path(__file__).resolve().parents[2] / "data" / "checkpoints" / "qwen3"
    model = str(build_shrunk_checkpoint(tmp_path / "plain-qwen3", published))
    lines = [_line("first", url, body), _line("second", url, body)]
    results, errors = _run(env, tmp_path, model, lines, capsys, rc=1)  # the job ends; all lines failed
    assert not results and len(errors) == 2
    for e in errors:
        message = e["response"]["body"]["error"]["message"]
        assert message.startswith(f"{'pair' if url == '/v1/score' else 'documents'}[0]: this model cannot score")
        assert "no scoring head" in message
