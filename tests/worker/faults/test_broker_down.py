"""Submitting with the broker down fails before anything is uploaded, and a job whose shards
could not be enqueued is taken up again by ``conveyor retry`` from its stored input."""

from __future__ import annotations

import json

from sqlalchemy import func, select

from conveyor.worker.broker.config import celery_app
from conveyor.worker.broker.queues import queue_depth, queue_name
from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import run_shard
from conveyor.worker.jobs.submission import SubmitOptions, submit_job
from conveyor.worker.store.models import Job
from tests.worker.helpers import jsonl, openai_lines

DOWN = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def _objects(client: Client) -> dict[str, int]:
    return {key: client.store.size(key) for key in client.store.list()}


def test_submit_with_the_broker_down_names_it_and_uploads_nothing(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack, broker_url=DOWN)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(50)))
    assert main(["submit", str(path), "--model", stack.model]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("conveyor: error: cannot reach the broker at redis://127.0.0.1:1/0"), err
    assert "CONVEYOR_BROKER_URL" in err and "\n" not in err and "internal error" not in err
    with Client(stack.settings) as client:
        with client.db.connect() as conn:
            assert conn.execute(select(func.count()).select_from(Job)).scalar_one() == 0
        assert _objects(client) == {}


def test_a_job_whose_enqueue_failed_is_retried_without_a_new_upload(embedded_stack, env, capsys) -> None:
    stack = env(embedded_stack)
    client = Client(stack.settings)

    def broker_lost(job_id: str, indices: object) -> None:  # the broker went away after the check
        raise ConnectionError("connection reset by the broker")

    options = SubmitOptions(model=stack.model, shard_size=3)
    try:
        submit_job(client.db, client.store, client.settings, _stream(7), options, enqueue=broker_lost)
    except Exception as exc:  # SubmitError, as a user would see it
        assert "could not enqueue" in str(exc)
    (job_id,) = _job_ids(client)
    assert client.status(job_id)["status"] == "failed"
    stored = _objects(client)
    assert any(key.endswith("input.jsonl") for key in stored)

    assert main(["retry", job_id, "--json"]) == 0
    job = json.loads(capsys.readouterr().out)
    assert job["status"] == "in_progress" and job["errors"] is None
    assert _objects(client) == stored  # nothing uploaded again
    app = celery_app(stack.settings, "probe")
    assert queue_depth(app, queue_name(job["model"], stack.settings.queue_prefix)) == 3  # 7 items in 3 shards
    app.close()

    ctx = WorkerContext.create(stack.settings)
    try:
        assert [run_shard(ctx, job_id, i).status for i in range(3)] == ["completed"] * 3
    finally:
        ctx.close()
    done = client.status(job_id)
    assert done["status"] == "completed" and done["request_counts"] == {"total": 7, "completed": 7, "failed": 0}

    assert main(["retry", job_id]) == 1  # only a job whose enqueue failed can be retried
    err = capsys.readouterr().err
    assert f"job {job_id} cannot be retried: it is completed" in err
    client.close()


def _stream(n: int):
    import io

    return io.BytesIO(jsonl(openai_lines(n)))


def _job_ids(client: Client) -> list[str]:
    with client.db.connect() as conn:
        return list(conn.execute(select(Job.id)).scalars())
