"""Score and rerank batches through the Files + Batches API with the official ``openai`` SDK
(``client.batches.create(endpoint="/v1/score" | "/v1/rerank")``) and a worker process: the
output file's bodies are vLLM's score and rerank responses with sentence-transformers'
``CrossEncoder`` scores, and a malformed line errors alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.score_checkpoints import build_cross_encoder
from tests.worker.api_batches import wait_batch
from tests.worker.helpers import Stack, jsonl, make_values
from tests.worker.openai_shapes import check_output_line

NAME = "tiny-reranker"
QUERY = "the chef brings hot soup"
DOCUMENTS = ["soup is hot", "tea and cake " * 6, "the guest pays the bill"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    return build_cross_encoder(tmp_path_factory.mktemp("score-api") / "xlm-r", "xlm-roberta")


def _reference(model: str) -> list[float]:
    from sentence_transformers import CrossEncoder

    return [float(s) for s in CrossEncoder(model, device="cpu").predict([[QUERY, d] for d in DOCUMENTS])]


def test_score_and_rerank_batches_through_the_sdk(cross_encoder, tmp_path, serve, spawn_worker) -> None:
    engine = {"num_kv_blocks": 256, "max_num_seqs": 16, "dtype": "float32"}
    stack = Stack(make_values(tmp_path / "home", cross_encoder, engine_args=engine), cross_encoder)
    worker = spawn_worker(stack, served_model_name=NAME)
    server = serve(stack)
    client = server.client(server.new_key("alice"))
    worker.wait_ready()
    want = _reference(cross_encoder)
    bodies: dict[str, list[dict[str, Any]]] = {
        "/v1/score": [
            {"model": NAME, "text_1": QUERY, "text_2": DOCUMENTS},
            {"model": NAME, "text_1": QUERY, "text_2": []},  # malformed: no documents
        ],
        "/v1/rerank": [
            {"model": NAME, "query": QUERY, "documents": DOCUMENTS, "top_n": 2},
            {"model": NAME, "query": QUERY},  # malformed: no documents
        ],
    }
    for url, (good, bad) in bodies.items():
        rows = [
            {"custom_id": "good", "method": "POST", "url": url, "body": good},
            {"custom_id": "bad", "method": "POST", "url": url, "body": bad},
        ]
        uploaded = client.files.create(file=(f"{url[4:]}.jsonl", jsonl(rows)), purpose="batch")
        created = client.batches.create(
            input_file_id=uploaded.id,
            endpoint=url,
            completion_window="24h",
        )
        batch = wait_batch(client, created.id)
        assert batch.status == "completed" and batch.endpoint == url, batch
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
        assert batch.output_file_id is not None and batch.error_file_id is not None
        [result] = [
            check_output_line(line, results=True)
            for line in client.files.content(batch.output_file_id).text.splitlines()
        ]
        [error] = [
            check_output_line(line, results=False)
            for line in client.files.content(batch.error_file_id).text.splitlines()
        ]
        assert result.custom_id == "good" and error.custom_id == "bad"
        assert error.error is not None and ("text_2" in error.error.message or "documents" in error.error.message)
        assert result.response is not None
        body = result.response.body
        assert body["model"] == NAME
        if url == "/v1/score":
            got = [d["score"] for d in body["data"]]
            expected = want
        else:
            order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])[:2]
            assert [r["index"] for r in body["results"]] == order
            got = [r["relevance_score"] for r in body["results"]]
            expected = [want[i] for i in order]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
