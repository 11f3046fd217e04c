"""A cancelled job accounts for every line: results plus ``batch_cancelled`` errors equal the
input, ``results --unfinished`` gives back the unrun lines verbatim, and submitting them
finishes the work, each line answered exactly once. Driven through the CLI on PostgreSQL, the
broker and S3, with the shards run in-process on the tiny model."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future

from conveyor.engine import EngineConfig, SamplingParams
from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.engine_host import EngineHost, RequestHandle
from conveyor.worker.execution.shard_runner import run_shard
from conveyor.worker.jobs.submission import SubmitOptions, create_job
from tests.worker.helpers import jsonl, openai_lines


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _submit(path, model: str, capsys) -> dict:
    assert main(["submit", str(path), "--model", model, "--shard-size", "3", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cancel_mid_job_answers_every_line_once_and_the_rest_resubmits(
    pg_redis_s3_stack, env, tmp_path, capsys
) -> None:
    stack = env(pg_redis_s3_stack)
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(openai_lines(9)) + b"\n")  # a blank line: line numbers skip it
    job = _submit(source, stack.model, capsys)
    ctx = WorkerContext.create(stack.settings)
    try:
        assert run_shard(ctx, job["id"], 0).status == "completed"  # 3 of 9 answered, then the cancel
        assert main(["cancel", job["id"]]) == 0
        assert "3 completed, 6 failed of 9" in capsys.readouterr().out  # the true counts, not 0 and 0
        out, err, rest = tmp_path / "out.jsonl", tmp_path / "err.jsonl", tmp_path / "rest.jsonl"
        assert main(["results", job["id"], "-o", str(out)]) == 0
        assert main(["results", job["id"], "--errors", "-o", str(err)]) == 0
        assert main(["results", job["id"], "--unfinished", "-o", str(rest)]) == 0
        answered = [r["custom_id"] for r in _lines(out)]
        errors = _lines(err)
        assert answered == ["req-0", "req-1", "req-2"]
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and all(
            e["response"] is None for e in errors
        )
        assert sorted(answered + [e["custom_id"] for e in errors]) == sorted(f"req-{i}" for i in range(9))
        wanted = source.read_bytes().splitlines(keepends=True)[3:9]  # the unrun input lines, byte for byte
        assert rest.read_bytes() == b"".join(wanted)

        again = _submit(rest, stack.model, capsys)
        for index in range(again["num_shards"]):
            assert run_shard(ctx, again["id"], index).status == "completed"
        assert main(["results", again["id"], "-o", str(tmp_path / "again.jsonl")]) == 0
        second = [r["custom_id"] for r in _lines(tmp_path / "again.jsonl")]
        assert sorted(answered + second) == sorted(f"req-{i}" for i in range(9))  # each exactly once
        assert main(["results", again["id"], "--unfinished"]) == 0  # completed: nothing left
        assert capsys.readouterr().out == ""
    finally:
        ctx.close()


def test_a_job_cancelled_before_its_intake_reports_each_line_and_gives_it_back(embedded_stack) -> None:
    client = Client(embedded_stack.settings)
    data = jsonl(openai_lines(4))
    client.store.put_bytes("uploads/in.jsonl", data)
    uri = client.store.uri("uploads/in.jsonl")
    job_id = create_job(client.db, client.store, client.settings, uri, SubmitOptions(model=embedded_stack.model))[0][
        "id"
    ]
    ended = client.cancel(job_id)
    assert ended["status"] == "cancelled" and ended["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    errors = [json.loads(line) for line in client.result_bytes(job_id, errors=True)]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"req-{i}", "batch_cancelled") for i in range(4)]
    assert b"".join(client.unfinished_bytes(job_id)) == data
    client.close()


def test_withdrawing_keeps_the_running_request_and_stops_the_waiting_ones(tiny_model) -> None:
    """A cancel's seam: the engine runs one request at a time; withdrawn, that one finishes
    with its tokens while those still waiting come back aborted before they started."""
    host = EngineHost.from_config(EngineConfig(tiny_model, device="cpu", max_num_seqs=1), input_threads=0)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    try:
        handles: list[RequestHandle] = [host.submit("Tea", long, tag=0)]
        deadline = time.monotonic() + 30
        while host.stats().live_requests < 1 and time.monotonic() < deadline:  # the first is in the engine
            time.sleep(0.01)
        with host._cv:  # the loop takes these in with their withdrawals: they wait behind the first
            handles += [host.submit("Tea", long, tag=i) for i in (1, 2)]
            for handle in handles:
                host.withdraw(handle)
        done = [h.future.result(timeout=120) for h in handles]
    finally:
        host.close()
    futures: list[Future] = [h.future for h in handles]
    assert all(f.done() for f in futures)
    assert not done[0].aborted and len(done[0].outputs[-1].token_ids) == 400
    assert all(d.aborted_before_start for d in done[1:])
