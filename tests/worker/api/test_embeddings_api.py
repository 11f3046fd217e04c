"""An embeddings batch through the Files + Batches API with the official ``openai`` SDK
(``client.batches.create(endpoint="/v1/embeddings")``) and a worker process: the output file's
bodies are OpenAI's ``CreateEmbeddingResponse`` with sentence-transformers' vectors."""

from __future__ import annotations

import json

import pytest

from tests.engine.embedding_helpers import TEXTS, assert_same_vectors, reference_vectors, sentence_transformers_model
from tests.worker.api_batches import wait_batch
from tests.worker.helpers import Stack, jsonl, make_values
from tests.worker.openai_shapes import check_output_line

EMBEDDINGS = "/v1/embeddings"
NAME = "tiny-embed"


@pytest.fixture(scope="module")
def st_root(tmp_path_factory):
    return tmp_path_factory.mktemp("st-models")


def test_an_embeddings_batch_through_the_sdk(st_root, tmp_path, serve, spawn_worker) -> None:
    model = sentence_transformers_model(st_root, "qwen3", "last", True)
    engine = {"num_kv_blocks": 256, "max_num_seqs": 16, "dtype": "float32"}
    stack = Stack(make_values(tmp_path / "home", model, engine_args=engine), model)
    worker = spawn_worker(stack, served_model_name=NAME)
    server = serve(stack)
    client = server.client(server.new_key("alice"))
    worker.wait_ready()
    rows = [
        {"custom_id": f"e{i}", "method": "POST", "url": EMBEDDINGS, "body": {"model": NAME, "input": text}}
        for i, text in enumerate(TEXTS)
    ]
    rows.append({"custom_id": "all", "method": "POST", "url": EMBEDDINGS, "body": {"model": NAME, "input": TEXTS}})
    uploaded = client.files.create(file=("embed.jsonl", jsonl(rows)), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint=EMBEDDINGS, completion_window="24h")
    batch = wait_batch(client, created.id)
    assert batch.status == "completed" and batch.endpoint == EMBEDDINGS, batch
    assert batch.request_counts is not None and batch.request_counts.completed == len(rows)
    assert batch.output_file_id is not None
    text = client.files.content(batch.output_file_id).text
    lines = [check_output_line(line, results=True) for line in text.splitlines()]
    bodies = {line.custom_id: line.response.body for line in lines if line.response is not None}
    ref = reference_vectors(model, TEXTS)
    got = [bodies[f"e{i}"]["data"][0]["embedding"] for i in range(len(TEXTS))]
    assert_same_vectors(got, ref)
    assert_same_vectors([d["embedding"] for d in bodies["all"]["data"]], ref)
    assert bodies["all"]["model"] == NAME and json.dumps(bodies["all"]["usage"])
