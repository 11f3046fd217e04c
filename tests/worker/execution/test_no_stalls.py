"""One line or one tenant never stalls another, end to end on PostgreSQL, Redis and S3.

Each attack of issue 41 runs beside owner B's one-line batch, whose time alone is the
baseline: a schema that compiles for minutes, forty prompts of about a megabyte, and owner
A's backlog holding every place of the worker. The bad lines fail alone with their codes,
and B's batch finishes about as fast as alone (the bounds are the issue's, generous for a
busy 2-CPU machine; ``benchmarks/bench_fair_share.py`` measures the times themselves)."""

from __future__ import annotations

import json
import time
from typing import Any, Final

import openai
import pytest

from tests.worker.helpers import jsonl, openai_lines

CHAT: Final = "/v1/chat/completions"
MODEL = "tiny-chat"
WITHIN_BASELINE_SECONDS = 5.0
FAIRNESS_BOUND_SECONDS = 10.0


def pattern_schema(n: int) -> dict[str, Any]:
    """700 ``patternProperties`` (25 KB): minutes of llguidance's compile."""
    return {"type": "object", "patternProperties": {f"^k{i}[a-z]+x$": {"type": "integer"} for i in range(n)}}


def _lines(count: int, prefix: str, max_tokens: int = 8, **extra: Any) -> list[dict[str, Any]]:
    rows = openai_lines(count, max_tokens=max_tokens, ignore_eos=True, prefix=prefix)
    for row in rows:
        row["body"]["model"] = MODEL
        row["body"].update(extra)
    return rows


def _create(client: openai.OpenAI, rows: list[dict[str, Any]]) -> str:
    upload = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h").id


def _wait_done(client: openai.OpenAI, batch_id: str, timeout: float) -> float:
    start = time.monotonic()
    while client.batches.retrieve(batch_id).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() - start < timeout, f"batch {batch_id} not done within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - start


def _errors(client: openai.OpenAI, batch_id: str) -> dict[str, dict[str, Any]]:
    batch = client.batches.retrieve(batch_id)
    if batch.error_file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    return {line["custom_id"]: line["response"]["body"]["error"] for line in lines}


@pytest.fixture
def tenants(pg_redis_s3_stack, serve, spawn_worker):
    def start(concurrency: int = 2, **values: Any) -> tuple[openai.OpenAI, openai.OpenAI]:
        stack = pg_redis_s3_stack.with_values(models=[MODEL], **values)
        worker = spawn_worker(stack, concurrency=concurrency, served_model_name=MODEL)
        server = serve(stack)
        a, b = server.client(server.new_key("owner-a")), server.client(server.new_key("owner-b"))
        worker.wait_ready()
        return a, b

    return start


def _baseline(b: openai.OpenAI) -> float:
    _wait_done(b, _create(b, _lines(1, "warm")), 120)  # the engine's first steps are slower
    return _wait_done(b, _create(b, _lines(1, "alone")), 60)


def test_a_grammar_that_compiles_for_minutes_fails_alone(tenants) -> None:
    a, b = tenants(grammar_compile_seconds=3.0)
    baseline = _baseline(b)
    bomb = {"type": "json_schema", "json_schema": {"name": "bomb", "schema": pattern_schema(700)}}
    rows = _lines(3, "a") + _lines(1, "bomb", response_format=bomb)
    attack = _create(a, rows)
    time.sleep(0.5)  # the bomb is compiling
    took = _wait_done(b, _create(b, _lines(1, "b")), 60)
    assert took <= baseline + WITHIN_BASELINE_SECONDS, (took, baseline)
    _wait_done(a, attack, 120)
    errors = _errors(a, attack)
    assert set(errors) == {"bomb-0"} and errors["bomb-0"]["code"] == "grammar_too_complex", errors
    counts = a.batches.retrieve(attack).request_counts
    assert counts is not None and (counts.completed, counts.failed) == (3, 1)


def test_forty_megabyte_prompts_fail_alone_without_stalling_another_owner(tenants) -> None:
    a, b = tenants()
    baseline = _baseline(b)
    word = "lorem ipsum dolor sit amet "
    huge = word * (1_000_000 // len(word))
    rows = _lines(40, "huge")
    for row in rows:
        row["body"]["messages"][0]["content"] = huge
    attack = _create(a, rows)
    took = _wait_done(b, _create(b, _lines(1, "b")), 120)
    assert took <= baseline + WITHIN_BASELINE_SECONDS, (took, baseline)
    _wait_done(a, attack, 300)
    errors = _errors(a, attack)
    assert len(errors) == 40 and {e["code"] for e in errors.values()} == {"prompt_too_long"}, list(errors.values())[:1]


@pytest.mark.parametrize("concurrency", [2, 1])
def test_an_owner_holding_every_place_gives_one_back(tenants, concurrency: int) -> None:
    a, b = tenants(concurrency=concurrency)
    backlog = _create(a, _lines(600, "a", max_tokens=200))
    start = time.monotonic()
    while (
        a.batches.retrieve(backlog).request_counts or openai.types.BatchRequestCounts(completed=0, failed=0, total=0)
    ).completed < 1:
        assert time.monotonic() - start < 180, "owner A's first results"
        time.sleep(0.2)
    took = _wait_done(b, _create(b, _lines(1, "b")), 120)
    assert took <= FAIRNESS_BOUND_SECONDS, took
    batch = a.batches.retrieve(backlog)
    assert batch.status == "in_progress"  # A's backlog still runs, and lost nothing:
    a.batches.cancel(backlog)
