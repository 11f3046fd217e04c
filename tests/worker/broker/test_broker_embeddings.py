"""``/v1/embeddings`` lines through the broker door: a plain kombu producer (the docs' example,
no conveyor import) submits them to a worker subprocess serving an encoder embedder, hears the
job's end, and the results are OpenAI's embeddings responses with sentence-transformers' vectors."""

from __future__ import annotations

import json
import uuid

import pytest

from conveyor.worker.entrypoints.client import Client
from tests.engine.embedding_helpers import TEXTS, assert_same_vectors, reference_vectors, sentence_transformers_encoder
from tests.worker.broker_messages import load_example, producer, reply_queue, upload
from tests.worker.helpers import Stack
from tests.worker.openai_shapes import check_output_line


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """The stack's model (the conftest's is a decoder): a tiny XLM-R with mean pooling, normalised."""
    return sentence_transformers_encoder(tmp_path_factory.mktemp("st-encoder"), "xlm-roberta", "mean", True)


def test_a_kombu_producer_submits_embeddings_lines_and_they_complete(pg_redis_s3_stack, spawn_worker) -> None:
    stack: Stack = pg_redis_s3_stack
    lines = [
        {"custom_id": "all", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": TEXTS}},
        {"custom_id": "one", "method": "POST", "url": "/v1/embeddings", "body": {"input": TEXTS[0], "dimensions": 16}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}},
    ]
    client = Client(stack.settings)
    uri = upload(client, lines, key="inputs/embeddings.jsonl")
    worker = spawn_worker(stack)
    worker.wait_ready()
    example = load_example()
    key = f"embed-{uuid.uuid4().hex[:8]}"
    with producer(stack) as conn, reply_queue(conn) as replies:
        fields = {"input_uri": uri, "model": stack.model, "idempotency_key": key, "reply_to": replies}
        example.submit(conn, fields, stack.values["queue_prefix"])
        end = example.wait_for_end(conn, replies, key, timeout=120)
    assert end["event"] == "batch.completed" and end["status"] == "completed", worker.log()[-3000:]
    batch = end["batch"]
    assert batch["endpoint"] == "/v1/embeddings"
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    results = [line.decode() for line in client.result_bytes(end["job_id"])]
    for line in results:
        check_output_line(line, results=True)
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, results)}
    assert sorted(bodies) == ["all", "one"]
    assert_same_vectors([d["embedding"] for d in bodies["all"]["data"]], reference_vectors(stack.model, TEXTS))
    want = reference_vectors(stack.model, TEXTS[:1], 16)
    assert_same_vectors([d["embedding"] for d in bodies["one"]["data"]], want)
    [error] = [json.loads(line) for line in client.result_bytes(end["job_id"], errors=True)]
    assert error["custom_id"] == "bad" and "input[0] is empty" in json.dumps(error)
    client.close()
