"""Completion windows: a job past its window ends ``expired``, with what finished kept and
every other request a ``batch_expired`` error, whether or not any worker serves its model."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

from sqlalchemy import select, update

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import run_shard
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Item, Job
from tests.worker.helpers import PYTHON, REPO, SLOW_ENGINE, jsonl, openai_lines, parse_lines, wait_for

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


def _cli(stack, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The real ``conveyor`` CLI in a subprocess (so a hang is a timeout, not a hung test)."""
    return subprocess.run(
        [PYTHON, "-m", "conveyor.worker.entrypoints.cli", *args],
        cwd=REPO, env=stack.env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_an_unserved_job_expires_at_its_window_and_follow_ends(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack.with_values(min_completion_window_seconds=1))
    path = tmp_path / "in.jsonl"
    rows: list = [*openai_lines(5)]
    rows.insert(2, b"{not json")  # a line rejected at validation stays in the errors file
    path.write_bytes(jsonl(rows))
    assert main(["submit", str(path), "--model", stack.model, "--completion-window", "3s"]) == 0
    job_id = capsys.readouterr().out.strip()
    # No worker serves the model: following the results must still end, at the window.
    t0 = time.monotonic()
    followed = _cli(stack, "results", job_id, "--follow", timeout=60)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout == ""  # nothing finished
    assert time.monotonic() - t0 < 30
    done = _cli(stack, "status", job_id, "--json", timeout=60)
    job = json.loads(done.stdout)
    assert job["status"] == "expired", job
    assert job["expired_at"] is not None and job["expired_at"] >= job["expires_at"]
    assert job["request_counts"] == {"total": 6, "completed": 0, "failed": 6}
    errors = parse_lines(_cli(stack, "results", job_id, "--errors", timeout=60).stdout.splitlines())
    assert [e["custom_id"] for e in errors] == ["req-0", "req-1", "line-3", "req-2", "req-3", "req-4"]
    expired = [e for e in errors if e["custom_id"] != "line-3"]
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in expired), expired
    assert all(e["error"]["message"] == EXPIRED_MESSAGE for e in expired)
    # Expiry is idempotent: asking again changes nothing.
    again = json.loads(_cli(stack, "status", job_id, "--json", timeout=60).stdout)
    assert again["status"] == "expired" and again["expired_at"] == job["expired_at"]
    assert again["request_counts"] == job["request_counts"]


def test_a_partly_done_job_keeps_its_finished_results_when_it_expires(embedded_stack) -> None:
    stack = embedded_stack.with_values(min_completion_window_seconds=1)
    client = Client(stack.settings)
    job = client.submit(jsonl(openai_lines(8)), stack.model, shard_size=4, completion_window="2s", enqueue=False)
    ctx = WorkerContext.create(stack.settings)
    try:
        assert run_shard(ctx, job["id"], 0).status == "completed"  # shard 1 never runs
    finally:
        ctx.close()
    assert client.status(job["id"])["status"] in ("in_progress", "expired")
    time.sleep(max(0.0, job["expires_at"] + 1 - time.time()))
    job = client.wait(job["id"], timeout=10, poll=0.1)
    assert job["status"] == "expired", job
    assert job["request_counts"] == {"total": 8, "completed": 4, "failed": 4}
    assert job["output_file_id"] and job["error_file_id"]
    results = parse_lines(client.results(job["id"]))
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(4)]
    assert all(r["response"]["status_code"] == 200 for r in results)
    errors = parse_lines(client.results(job["id"], errors=True))
    assert [e["custom_id"] for e in errors] == [f"req-{i}" for i in range(4, 8)]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    client.close()


def test_a_worker_expires_a_running_job_and_stops_its_shards(embedded_stack, spawn_worker) -> None:
    """No client asks: the worker's own expiry thread stops the running shards at the window."""
    stack = embedded_stack.with_values(engine_args=SLOW_ENGINE)
    worker = spawn_worker(stack, concurrency=2)
    worker.wait_ready()
    client = Client(stack.settings)
    n = 24
    job = client.submit(jsonl(openai_lines(n, max_tokens=240, ignore_eos=True)), stack.model, shard_size=4)
    db = create_db_engine(stack.settings.database)

    def stored() -> int:
        with db.connect() as conn:
            return len(conn.execute(select(Item.custom_id).where(Item.job_id == job["id"])).all())

    def status() -> str:
        with db.connect() as conn:
            return conn.execute(select(Job.status).where(Job.id == job["id"])).scalar_one()

    wait_for(lambda: stored() >= 2, 90, "the first items")
    with db.begin() as conn:  # the window ends now
        conn.execute(update(Job).where(Job.id == job["id"]).values(expires_at=time.time() - 1))
    wait_for(lambda: status() == "expired", 30, "the worker to expire the job")
    job = client.status(job["id"])
    counts = job["request_counts"]
    assert counts["total"] == n and counts["completed"] + counts["failed"] == n, counts
    assert 2 <= counts["completed"] < n
    results = parse_lines(client.results(job["id"]))
    errors = parse_lines(client.results(job["id"], errors=True))
    assert len(results) == counts["completed"] and all(r["response"]["status_code"] == 200 for r in results)
    assert Counter(e["error"]["code"] for e in errors) == {"batch_expired": counts["failed"]}
    assert sorted(r["custom_id"] for r in results + errors) == sorted(f"req-{i}" for i in range(n))
    assert "passed its completion window" in worker.log()
    db.dispose()
    client.close()
