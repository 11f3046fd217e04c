"""A job end to end through a real broker and worker subprocesses, on each service stack."""

from __future__ import annotations

import json

from sqlalchemy import func, select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.entrypoints.local_runner import run_job
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import EngineSnapshot, Item, Shard, ShardStatus
from tests.worker.helpers import REPO, jsonl, openai_lines, parse_lines, wait_for

EXAMPLE = REPO / "examples" / "requests.jsonl"  # chat
COMPLETIONS_EXAMPLE = REPO / "examples" / "completions.jsonl"


def _texts(lines: list[dict]) -> dict[str, list]:
    """custom_id -> what the model produced (ids and timestamps differ between jobs)."""
    out = {}
    for line in lines:
        body = line["response"]["body"]
        choices = [c.get("message", {}).get("content", c.get("text")) for c in body["choices"]]
        out[line["custom_id"]] = [choices, body["usage"], [c["finish_reason"] for c in body["choices"]]]
    return out


def _check_example_job(client: Client, job: dict) -> None:
    assert job["status"] == "completed", job
    assert job["endpoint"] == "/v1/chat/completions"
    assert job["request_counts"] == {"total": 8, "completed": 6, "failed": 2}
    results = parse_lines(client.results(job["id"]))
    assert [r["custom_id"] for r in results] == ["chat-1", "chat-2", "chat-3", "chat-4", "chat-5", "chat-6"]
    by_id = {r["custom_id"]: r for r in results}
    assert by_id["chat-1"]["response"]["body"]["object"] == "chat.completion"
    assert len(by_id["chat-4"]["response"]["body"]["choices"]) == 2  # n=2
    assert by_id["chat-5"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    errors = parse_lines(client.results(job["id"], errors=True))
    assert [(e["custom_id"], e["error"]["line"], e["error"]["code"]) for e in errors] == [
        ("bad-1", 7, "invalid_value"),
        ("chat-7", 8, "invalid_json"),  # the id read from the cut-off line
    ]
    assert job["usage"]["output_tokens"] > 0 and job["metrics"]["items"] == 6
    assert job["metrics"]["ttft"]["p50"] is not None


def _check_completions_example_job(client: Client, job: dict) -> None:
    assert job["status"] == "completed", job
    assert job["endpoint"] == "/v1/completions"
    assert job["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    results = parse_lines(client.results(job["id"]))
    assert [r["custom_id"] for r in results] == [f"completion-{i}" for i in range(1, 6)]
    by_id = {r["custom_id"]: r for r in results}
    assert by_id["completion-1"]["response"]["body"]["object"] == "text_completion"
    assert by_id["completion-4"]["response"]["body"]["choices"][0]["logprobs"]["tokens"]
    assert parse_lines(client.results(job["id"], errors=True)) == []


def test_embedded_defaults_queued_matches_in_process_run(embedded_stack, spawn_worker) -> None:
    """Plain `celery -A conveyor.worker.app worker` on SQLite + the SQLAlchemy broker + a local
    directory; the in-process `conveyor run` path gives the same results."""
    worker = spawn_worker(embedded_stack, plain_celery=True)
    client = Client(embedded_stack.settings)
    job = client.submit(EXAMPLE, embedded_stack.model)
    completions = client.submit(COMPLETIONS_EXAMPLE, embedded_stack.model)
    assert job["status"] == "in_progress" and job["num_shards"] == 2
    job = client.wait(job["id"], timeout=90, poll=0.2)
    _check_example_job(client, job)
    completions = client.wait(completions["id"], timeout=90, poll=0.2)
    _check_completions_example_job(client, completions)
    assert "ready." in worker.log()

    local = run_job(embedded_stack.settings, EXAMPLE, embedded_stack.model)
    _check_example_job(client, local)
    local_completions = run_job(embedded_stack.settings, COMPLETIONS_EXAMPLE, embedded_stack.model)
    _check_completions_example_job(client, local_completions)
    queued_lines = parse_lines(client.results(job["id"])) + parse_lines(client.results(completions["id"]))
    local_lines = parse_lines(client.results(local["id"])) + parse_lines(client.results(local_completions["id"]))
    greedy = {"chat-1", "chat-3", "chat-5", "chat-6", "completion-1", "completion-3", "completion-4"}
    assert {k: v for k, v in _texts(queued_lines).items() if k in greedy} == {
        k: v for k, v in _texts(local_lines).items() if k in greedy
    }
    client.close()


def _run_on_stack(stack, spawn_worker, n: int = 20, url: str = "/v1/chat/completions") -> None:
    spawn_worker(stack)
    client = Client(stack.settings)
    job = client.submit(jsonl(openai_lines(n, url=url)), stack.model, shard_size=3)
    job = client.wait(job["id"], timeout=90, poll=0.2)
    assert job["status"] == "completed", job
    assert job["request_counts"] == {"total": n, "completed": n, "failed": 0}
    assert job["output_uri"].startswith("s3://")
    ids = [r["custom_id"] for r in parse_lines(client.results(job["id"]))]
    assert ids == [f"req-{i}" for i in range(n)]
    db = create_db_engine(stack.settings.database)
    with db.connect() as conn:
        shards = conn.execute(select(Shard.status, Shard.output_uri).where(Shard.job_id == job["id"])).all()
        assert len(shards) == 7 and all(ShardStatus(s) is ShardStatus.completed and uri for s, uri in shards)
        items = conn.execute(
            select(Item.e2e, Item.ttft, Item.prompt_tokens, Item.worker_id).where(Item.job_id == job["id"])
        ).all()
        assert len(items) == n and all(e2e and ttft is not None and p > 0 and w for e2e, ttft, p, w in items)

    def snapshots() -> int:
        with db.connect() as conn:
            return conn.execute(
                select(func.count()).select_from(EngineSnapshot).where(EngineSnapshot.tokens_per_s > 0)
            ).scalar_one()

    wait_for(snapshots, 10, "an engine snapshot of the busy engine")
    db.dispose()
    client.close()


def test_postgres_redis_s3(pg_redis_s3_stack, spawn_worker) -> None:
    _run_on_stack(pg_redis_s3_stack, spawn_worker)


def test_postgres_rabbitmq_s3(pg_amqp_s3_stack, spawn_worker) -> None:
    _run_on_stack(pg_amqp_s3_stack, spawn_worker, url="/v1/completions")


def test_postgres_sqs_s3(pg_sqs_s3_stack, spawn_worker) -> None:
    _run_on_stack(pg_sqs_s3_stack, spawn_worker)


def test_settings_travel_as_json_env(embedded_stack) -> None:
    env = embedded_stack.env()
    assert json.loads(env["CONVEYOR_ENGINE_ARGS"])["num_kv_blocks"] == 512
