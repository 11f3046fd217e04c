"""A poison item, one that crashes or hangs its worker process each time it runs, ends as
one error record for that item alone; every other item completes exactly once, including its
own shard's neighbours and the items of the other shards that died with it.

The poison is a test-only hook: ``CONVEYOR_TEST_CRASH_ON`` makes the engine host exit on the
spot (``os._exit``) when it is handed a prompt containing that text, as a crashing kernel
would; ``CONVEYOR_TEST_HANG_ON`` makes it hang there, as a stuck kernel would, and the step
watchdog (``CONVEYOR_STEP_TIMEOUT_SECONDS``) then ends the process. The test plays the
supervisor that restarts dead workers.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.engine_host import HUNG_EXIT_CODE
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Item, ItemCrash, ItemStatus, JobStatus, Shard
from tests.worker.helpers import jsonl, openai_lines, parse_lines
from tests.worker.openai_shapes import check_output_line

POISON = "POISON-PILL-5f3a"
MAX_CRASHES = 3  # the default CONVEYOR_ITEM_MAX_CRASHES


# How the poison kills the worker: (the test hook, the worker's exit status).
KINDS = {"crash": ("CONVEYOR_TEST_CRASH_ON", 70), "hang": ("CONVEYOR_TEST_HANG_ON", HUNG_EXIT_CODE)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_poison_item_becomes_one_error_and_everything_else_completes(
    pg_redis_s3_stack, spawn_worker, kind: str
) -> None:
    hook, exit_code = KINDS[kind]
    stack = pg_redis_s3_stack.with_values(item_max_crashes=MAX_CRASHES, step_timeout_seconds=2.0)
    stack.extra_env[hook] = POISON
    n, bad = 12, 5
    lines = openai_lines(n, max_tokens=16)
    lines[bad]["body"]["messages"][0]["content"] += f" {POISON}"
    workers = [spawn_worker(stack, concurrency=2), spawn_worker(stack, concurrency=2)]
    client = Client(stack.settings)
    job = client.submit(jsonl(lines), stack.model, shard_size=4)
    job_id = job["id"]

    deaths = 0
    deadline = time.monotonic() + 150
    while not JobStatus(client.status(job_id)["status"]).terminal:
        assert time.monotonic() < deadline, f"the job did not finish; {deaths} worker deaths"
        for w in list(workers):
            if w.proc.poll() is not None:  # died: a supervisor would restart it
                assert w.proc.returncode == exit_code, w.log()[-2000:]
                deaths += 1
                workers.remove(w)
                workers.append(spawn_worker(stack, concurrency=2))
        time.sleep(0.2)

    job = client.status(job_id)
    assert job["status"] == "completed", job
    assert job["request_counts"] == {"total": n, "completed": n - 1, "failed": 1}
    raw = client.results(job_id, errors=True)
    assert not isinstance(raw, int)  # (an int only when written to a file)
    error_lines = list(raw)
    errors = parse_lines(error_lines)
    assert [e["custom_id"] for e in errors] == [f"req-{bad}"]
    # It ran and the server failed it: OpenAI's format gives an HTTP response (status 500, a
    # body with a server_error), and error null (kept for requests that got no response).
    (crashed,) = errors
    line = check_output_line(error_lines[0], results=False)  # the strict line model, SDK-typed body
    assert line.error is None and line.response is not None and line.response.status_code == 500
    body = line.response.body["error"]
    assert (body["type"], body["code"], body["param"]) == ("server_error", "worker_crashed", None)
    assert body["message"], crashed
    ids = [r["custom_id"] for r in parse_lines(client.results(job_id))]
    assert ids == [f"req-{i}" for i in range(n) if i != bad]  # each other item once, in order
    db = create_db_engine(stack.settings.database)
    with db.connect() as conn:
        per_item = conn.execute(
            select(Item.custom_id, func.count()).where(Item.job_id == job_id).group_by(Item.custom_id)
        ).all()
        failed_ids = list(
            conn.execute(
                select(Item.custom_id).where(Item.job_id == job_id, Item.status == ItemStatus.failed)
            ).scalars()
        )
        rows = conn.execute(select(ItemCrash.custom_id, ItemCrash.crashes).where(ItemCrash.job_id == job_id))
        crashes = {custom_id: count for custom_id, count in rows}
        failures = conn.execute(select(func.sum(Shard.failures)).where(Shard.job_id == job_id)).scalar_one()
    assert len(per_item) == n and {count for _, count in per_item} == {1}
    assert failed_ids == [f"req-{bad}"]
    assert crashes == {f"req-{bad}": MAX_CRASHES}, "only the poison item is charged with crashes"
    assert failures == 0
    assert deaths >= 1 + MAX_CRASHES
    db.dispose()
    client.close()
