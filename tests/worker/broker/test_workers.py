"""The worker registry: submit warns and status says when no live worker serves a job's
model; a worker that cannot load its model exits before consuming and never counts as one."""

from __future__ import annotations

import json
import shutil

import pytest
from sqlalchemy import select, update

from conveyor.worker.broker.app import create_app
from conveyor.worker.broker.queues import queue_depth
from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.models import Worker, WorkerState, now
from conveyor.worker.store.workers import model_service, prune_workers, register_worker, set_worker_state
from tests.worker.helpers import jsonl, openai_lines, wait_for


def _submit(capsys, path, model: str) -> tuple[dict, str]:
    assert main(["submit", str(path), "--model", model, "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def _status(capsys, job_id: str) -> tuple[dict, str]:
    assert main(["status", job_id, "--json"]) == 0
    job = json.loads(capsys.readouterr().out)
    assert main(["status", job_id]) == 0
    return job, capsys.readouterr().out


def test_submit_warns_and_status_says_when_no_live_worker_serves_the_model(
    embedded_stack, env, spawn_worker, tmp_path, capsys
) -> None:
    stack = env(embedded_stack.with_values(worker_live_seconds=3))
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(2)))
    job, err = _submit(capsys, path, stack.model)
    model = job["model"]
    assert job["status"] == "in_progress"  # still created: a worker may start later
    start = f"start one with: conveyor worker --model {model}"
    assert err.strip() == f"conveyor: warning: no live worker serves model {model}; {start}"
    obj, text = _status(capsys, job["id"])
    assert obj["serving"]["live_workers"] == 0 and obj["serving"]["last_heartbeat_at"] is None
    assert f"no worker has ever served model {model}; {start}" in text

    worker = spawn_worker(stack)
    worker.wait_ready()
    with Client(stack.settings) as client:
        assert client.wait(job["id"], timeout=90, poll=0.2)["status"] == "completed"
    served, err = _submit(capsys, path, stack.model)
    assert "warning" not in err
    obj, text = _status(capsys, served["id"])
    if obj["status"] != "completed":
        assert obj["serving"]["live_workers"] == 1 and "no worker" not in text

    worker.stop()  # stopped, or killed before it could say so: its heartbeat ages out
    with Client(stack.settings) as client:
        wait_for(lambda: client.model_service(model).live == 0, 15, "the worker to stop counting as live")
    job, err = _submit(capsys, path, stack.model)
    assert f"no live worker serves model {model}" in err
    obj, text = _status(capsys, job["id"])
    assert obj["serving"]["live_workers"] == 0 and obj["serving"]["last_heartbeat_at"] is not None
    assert f"no worker has served model {model} for " in text and "(last heartbeat " in text


@pytest.mark.parametrize("plain_celery", [False, True], ids=["conveyor-worker", "celery"])
def test_a_worker_that_cannot_load_its_model_exits_before_consuming(
    embedded_stack, spawn_worker, tmp_path, plain_celery: bool
) -> None:
    broken = tmp_path / "corrupt-model"
    shutil.copytree(embedded_stack.model, broken)
    stack = embedded_stack.with_values(model=str(broken))
    client = Client(stack.settings)
    job = client.submit(jsonl(openai_lines(4)), str(broken), shard_size=2)  # loadable when submitted
    for weights in broken.glob("*.safetensors"):  # ... and damaged on the worker's side since
        weights.write_bytes(b"this is not a safetensors file")
    worker = spawn_worker(stack, plain_celery=plain_celery)
    code = worker.proc.wait(120)
    assert code != 0, worker.log()
    assert "conveyor worker: cannot start:" in worker.log()
    assert " ready." not in worker.log()
    app = create_app(stack.settings, str(broken))
    assert queue_depth(app, app.conf.task_default_queue) == 2  # nothing was consumed
    app.close()
    with client.db.connect() as conn:
        rows = conn.execute(select(Worker.state, Worker.error).where(Worker.model == job["model"])).all()
    assert [r.state for r in rows] == [WorkerState.failed] and rows[0].error, rows
    service = client.model_service(job["model"])
    assert service.live == 0 and service.last_heartbeat_at is None
    assert client.status(job["id"])["status"] == "in_progress"
    client.close()


def test_the_registry_forgets_long_silent_workers_but_keeps_each_models_newest(db_engine) -> None:
    day = 86_400.0
    ages = {"a-oldest": 9 * day, "a-old": 8 * day, "a-live": 10.0, "b-only": 8 * day}
    ids = {}
    for name, age in ages.items():
        ids[name] = register_worker(db_engine, f"{name[0]}-model", "q")
        set_worker_state(db_engine, ids[name], WorkerState.stopped)
        with db_engine.begin() as conn:
            conn.execute(update(Worker).where(Worker.id == ids[name]).values(heartbeat_at=now() - age))
    assert prune_workers(db_engine, older_than=7 * day) == 2
    with db_engine.connect() as conn:
        left = set(conn.execute(select(Worker.id)).scalars())
    assert left == {ids["a-live"], ids["b-only"]}  # b's only worker stays: its model was served once
    assert model_service(db_engine, "b-model", 60).last_heartbeat_at == pytest.approx(now() - 8 * day, abs=60)
    assert prune_workers(db_engine, older_than=7 * day) == 0
