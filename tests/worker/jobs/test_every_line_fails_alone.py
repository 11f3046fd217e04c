"""Whatever one line's parsing or validation raises, that line fails alone and the job runs
to its end (issue 41: a ``RecursionError`` from ``"[" * 200000`` in a tool call's arguments
wedged intake, the batch ``validating`` with 0 lines, re-sent every 300 s)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.worker.batchio import records
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.shard_runner import run_shard
from conveyor.worker.jobs import intake
from conveyor.worker.jobs.submission import SubmitOptions, create_job, ingest_job
from conveyor.worker.store.objects.base import StorageUnavailable
from tests.worker.helpers import jsonl, openai_lines, parse_lines

BOMB = "[" * 200_000


def _chat(custom_id: str, **body: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "Bring soup"}], "max_tokens": 2, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _bombs() -> list[Any]:
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": BOMB}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [tool_call]}]
    return [
        _chat("tool-arguments", messages=history),
        _chat("structured-json", structured_outputs={"json": BOMB}),
        _chat("schema-text", response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": BOMB}}),
        _chat("tool-schema", tools=[{"type": "function", "function": {"name": "f", "parameters": _deep_schema(400)}}]),
        ("[" * 200_000).encode(),  # the whole line
    ]


def _stored(client: Client, rows: list[Any]) -> str:
    client.store.put_bytes("uploads/input.jsonl", jsonl(rows))
    return client.store.uri("uploads/input.jsonl")


def _run_to_the_end(stack: Any, client: Client, job_id: str) -> dict[str, Any]:
    ctx = WorkerContext.create(stack.settings)
    try:
        started = ingest_job(client.db, client.store, client.settings, job_id, enqueue=None)
        assert started["status"] == "in_progress", started
        assert run_shard(ctx, job_id, 0).status == "completed"  # one shard of 100 lines
    finally:
        ctx.close()
    return client.status(job_id)


def test_recursion_bombs_fail_alone_and_the_job_completes_on_postgres(pg_redis_s3_stack) -> None:
    client = Client(pg_redis_s3_stack.settings)
    rows = [*openai_lines(2, max_tokens=2), *_bombs()]
    job, _ = create_job(
        client.db, client.store, client.settings, _stored(client, rows),
        SubmitOptions(model=pg_redis_s3_stack.model, shard_size=100),
    )  # fmt: skip
    done = _run_to_the_end(pg_redis_s3_stack, client, job["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 7, "completed": 2, "failed": 5}
    errors = {e["error"]["line"]: e for e in parse_lines(client.results(job["id"], errors=True))}
    assert sorted(errors) == [3, 4, 5, 6, 7]
    assert errors[3]["custom_id"] == "tool-arguments" and "arguments" in errors[3]["error"]["message"]
    assert errors[4]["custom_id"] == "structured-json"
    assert errors[6]["custom_id"] == "tool-schema" and "nested" in errors[6]["error"]["message"]
    assert errors[7]["error"]["code"] == "invalid_json" and "nested too deeply" in errors[7]["error"]["message"]
    assert [r["custom_id"] for r in parse_lines(client.results(job["id"]))] == ["req-0", "req-1"]
    client.close()


# Each exception type a line's validation could raise, including those no validator means to.
RAISED = [
    RecursionError("maximum recursion depth exceeded"),
    MemoryError(),
    UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
    UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
    ValueError("bad"),
    TypeError("bad"),
    KeyError("k"),
    IndexError("i"),
    AttributeError("a"),
    OverflowError("o"),
    ZeroDivisionError("z"),
    AssertionError("a"),
    NotImplementedError("n"),
    json.JSONDecodeError("bad", "x", 0),
]


def test_any_exception_from_one_lines_validation_is_that_lines_error(embedded_stack, monkeypatch) -> None:
    validate = records.request_from_object

    def raising(obj: Any, line: int, *args: Any, **kwargs: Any) -> Any:
        index = obj.get("raise") if isinstance(obj, dict) else None
        if index is not None:
            raise RAISED[index]
        return validate(obj, line, *args, **kwargs)

    monkeypatch.setattr(records, "request_from_object", raising)
    client = Client(embedded_stack.settings)
    rows: list[Any] = [{"custom_id": "good-0", "prompt": "The chef cooks", "max_tokens": 2}]
    rows += [{"custom_id": f"bad-{i}", "prompt": "p", "raise": i} for i in range(len(RAISED))]
    rows.append({"custom_id": "good-1", "prompt": "The guest eats", "max_tokens": 2})
    job, _ = create_job(
        client.db, client.store, client.settings, _stored(client, rows),
        SubmitOptions(model=embedded_stack.model, shard_size=100),
    )  # fmt: skip
    done = _run_to_the_end(embedded_stack, client, job["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": len(RAISED) + 2, "completed": 2, "failed": len(RAISED)}
    errors = {e["custom_id"]: e["error"] for e in parse_lines(client.results(job["id"], errors=True))}
    assert set(errors) == {f"bad-{i}" for i in range(len(RAISED))}
    assert all(e["code"] == "invalid_request" for e in errors.values())
    assert "nested too deeply" in errors["bad-0"]["message"]
    assert "too large" in errors["bad-1"]["message"]
    assert "not valid Unicode" in errors["bad-2"]["message"] and "not valid Unicode" in errors["bad-3"]["message"]
    assert "(KeyError)" in errors["bad-6"]["message"]
    assert [r["custom_id"] for r in parse_lines(client.results(job["id"]))] == ["good-0", "good-1"]
    client.close()


def test_an_intake_that_would_fail_every_time_fails_the_job_at_once(embedded_stack, monkeypatch) -> None:
    """A backstop below the line guard: an unforeseen error in the intake itself ends the job
    with the reason instead of leaving it ``validating`` for the sweeper to resend all window."""
    client = Client(embedded_stack.settings)
    options = SubmitOptions(model=embedded_stack.model, shard_size=100)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(intake, "iter_input", broken)
    job, _ = create_job(client.db, client.store, client.settings, _stored(client, openai_lines(2)), options)
    failed = ingest_job(client.db, client.store, client.settings, job["id"], enqueue=None)
    (error,) = failed["errors"]["data"]
    assert failed["status"] == "failed" and error["code"] == "intake_failed" and "KeyError" in error["message"]

    def outage(*args: Any, **kwargs: Any) -> Any:
        raise StorageUnavailable("the store is down", transient=True)

    monkeypatch.setattr(intake, "iter_input", outage)
    waiting, _ = create_job(client.db, client.store, client.settings, _stored(client, openai_lines(2)), options)
    with pytest.raises(StorageUnavailable):  # an outage is retried, never a failed job
        ingest_job(client.db, client.store, client.settings, waiting["id"], enqueue=None)
    assert client.status(waiting["id"])["status"] == "validating"
    client.close()
