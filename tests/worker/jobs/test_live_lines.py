"""The follower of a job grouped by prefix (shards that interleave by line), with lines that
fail as they run and lines rejected at validation: in input order its results and errors are
the files' bytes, in completion order every line once."""

from __future__ import annotations

import json
import threading
from typing import Any

from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import run_shard
from tests.worker.helpers import jsonl, openai_lines


def _rows() -> list[Any]:
    rows: list[Any] = []
    for i, line in enumerate(openai_lines(10, max_tokens=2)):
        if i % 3 == 1:  # longer than the model's context: fails as it runs
            line["body"]["messages"][0]["content"] = "soup " * 80
        if i % 2:  # two prefixes, alternating: the grouped shards interleave by line
            line["body"]["messages"].insert(0, {"role": "system", "content": "Be brief."})
        rows.append(line)
    rows.insert(4, b"{not json")
    return rows


def test_following_a_grouped_job_in_either_order(embedded_stack) -> None:
    stack = embedded_stack.with_values(shard_order="prefix", engine_args={"num_kv_blocks": 256, "max_model_len": 48})
    client = Client(stack.settings)
    job = client.submit(jsonl(_rows()), stack.model, shard_size=2, enqueue=False)
    assert job["shard_order"] == "prefix" and job["num_shards"] >= 3
    followed: dict[tuple[bool, str], list[bytes]] = {}

    def follow(errors: bool, order: str) -> None:
        followed[errors, order] = list(client.result_bytes(job["id"], errors, follow=True, order=order, poll=0.02))

    readers = [threading.Thread(target=follow, args=(e, o)) for e in (False, True) for o in ("input", "completion")]
    for reader in readers:
        reader.start()
    ctx = WorkerContext.create(stack.settings)
    try:
        for index in range(job["num_shards"]):
            assert run_shard(ctx, job["id"], index).status == "completed"
    finally:
        ctx.close()
    for reader in readers:
        reader.join(30)
        assert not reader.is_alive()
    results, errors = list(client.result_bytes(job["id"])), list(client.result_bytes(job["id"], errors=True))
    failed_as_run = [line for line in errors if json.loads(line)["response"]]
    assert len(results) == 7 and len(failed_as_run) == 3 and len(errors) == 4  # and 1 rejected
    assert followed[False, "input"] == results and followed[True, "input"] == errors
    assert sorted(followed[False, "completion"]) == sorted(results)
    assert sorted(followed[True, "completion"]) == sorted(errors)
    ids = [json.loads(line)["id"] for line in followed[True, "completion"]]
    assert len(set(ids)) == len(ids)
    client.close()
