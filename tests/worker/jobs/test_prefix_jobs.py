"""A job grouped by shared prefix, end to end in one process: its shards are sets of lines,
its results and errors files are in input order, the same as an input-order run's."""

from __future__ import annotations

import itertools
import json

from sqlalchemy import select

from benchmarks.prefix_shapes import many_questions
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.entrypoints.local_runner import run_job
from conveyor.worker.jobs import object_keys
from conveyor.worker.store.models import Shard
from tests.worker.helpers import jsonl, parse_lines, read_object

# What differs between two runs of one request: ids and times, and what the prefix cache saved.
_VOLATILE = ("id", "created", "usage", "metrics")


def _stable(line: dict) -> tuple:
    body = line["response"]["body"] if line["response"] else None
    if body is not None:
        body = {k: v for k, v in body.items() if k not in _VOLATILE}
    return line["custom_id"], line["response"] and line["response"]["status_code"], body, line["error"]


def _rows() -> list:
    rows: list = []
    shape = many_questions(5, 4, 500, shuffled=True, seed=7, max_tokens=3)
    for i, line in enumerate(shape.lines):
        rows.append(line)
        if i % 6 == 2:
            rows.append(b"{not json")
    too_long = json.loads(json.dumps(shape.lines[0]))
    too_long["custom_id"] = "too-long"
    too_long["body"]["messages"][1]["content"] = "soup " * 1500  # fails in the engine: past max_model_len
    rows.insert(9, too_long)
    return rows


def test_grouped_and_input_order_runs_give_the_same_files_in_input_order(embedded_stack) -> None:
    stack = embedded_stack.with_values(engine_args={"num_kv_blocks": 512, "max_model_len": 1024})
    rows = _rows()
    grouped = run_job(stack.settings, jsonl(rows), stack.model, shard_size=4, shard_order="prefix", concurrency=2)
    plain = run_job(stack.settings, jsonl(rows), stack.model, shard_size=4, shard_order="input", concurrency=2)
    assert grouped["status"] == plain["status"] == "completed"
    assert grouped["shard_order"] == "prefix" and plain["shard_order"] == "input"
    assert grouped["request_counts"] == plain["request_counts"]
    client = Client(stack.settings)
    for errors in (False, True):
        a = parse_lines(client.results(grouped["id"], errors))
        b = parse_lines(client.results(plain["id"], errors))
        assert [_stable(x) for x in a] == [_stable(x) for x in b]
    order = [r["custom_id"] for r in parse_lines(client.results(grouped["id"]))]
    expected = [r["custom_id"] for r in rows if isinstance(r, dict) and r["custom_id"] != "too-long"]
    assert order == expected
    # The grouped job's shards are sets of lines: some interleave with others.
    with client.db.connect() as conn:
        ranges = conn.execute(
            select(Shard.first_line, Shard.last_line, Shard.group_key).where(Shard.job_id == grouped["id"])
        ).all()
    spans = sorted((first, last) for first, last, _key in ranges)
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans))
    # Every shard holds one document's questions (one of them the line that shares no document, too).
    assert len(ranges) == 5 and sum(key is None for _f, _l, key in ranges) <= 1
    prefix = grouped["prefix"]
    assert prefix["prompt_tokens"] > 0 and prefix["estimated_shared_prefix"] > 0.25
    assert (
        prefix["prefill_tokens_computed"]
        == grouped["usage"]["input_tokens"] - (grouped["usage"]["input_tokens_details"]["cached_tokens"])
    )
    # The results file holds the lines in input order, and the job's working objects went.
    store = client.store.scoped(object_keys.job_prefix(grouped["id"]))
    results = [json.loads(x)["custom_id"] for x in read_object(store, object_keys.RESULTS).splitlines()]
    assert results == expected
    assert list(store.list()) == [object_keys.ERRORS, object_keys.RESULTS]
    client.close()
