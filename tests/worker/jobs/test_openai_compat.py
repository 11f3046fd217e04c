"""What Conveyor shows of a job, read with the official ``openai`` SDK's own types.

``conveyor status --json`` (and ``submit --json``, ``cancel --json``, ``Client.status``) claims
to be OpenAI's batch object: it must validate as ``openai.types.Batch`` with strict types (no
coercion of ``"5"`` into ``5``), and hold a value wherever OpenAI always gives one.

The results and errors files claim OpenAI's batch output format. The SDK types the batch but
not the lines of its files, so ``BatchRequestOutput`` below is OpenAI's documented schema for
them (``{id, custom_id, response: {status_code, request_id, body} | null, error: {code,
message} | null}``); what sits inside is checked with the SDK's types (``ChatCompletion``,
``Completion``, and ``ErrorObject`` for an HTTP error's body).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from openai.types import Batch, BatchError, BatchRequestCounts

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.entrypoints.local_runner import run_job
from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.execution.engine_host import RequestHandle
from conveyor.worker.execution.shard_runner import RetryShard, run_shard
from conveyor.worker.jobs.finalize import claim_finalization
from conveyor.worker.jobs.submission import SubmitOptions, create_job
from conveyor.worker.store.leases import acquire_lease, release_lease
from conveyor.worker.store.models import ShardStatus
from tests.worker.helpers import jsonl, openai_lines
from tests.worker.openai_shapes import (
    BatchRequestOutput,
    check_output_line,
)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HOUR = 3600

# Timestamps each status implies (OpenAI sets them on the way there).
STAMPS = {
    "validating": (),
    "in_progress": ("in_progress_at",),
    "finalizing": ("in_progress_at", "finalizing_at"),
    "completed": ("in_progress_at", "finalizing_at", "completed_at"),
    "failed": ("failed_at",),
    "cancelling": ("cancelling_at",),
    "cancelled": ("cancelling_at", "cancelled_at"),
    "expired": ("expired_at",),
}
# Set once a job reaches that state, never before: each is set exactly when its status implies it.
ENDS = ("cancelling_at", "completed_at", "failed_at", "expired_at", "cancelled_at")


def check_batch(obj: dict[str, Any], status: str, *, window: str = "24h", window_s: int = 24 * HOUR) -> Batch:
    """``obj`` as OpenAI's ``Batch``, checked field by field."""
    batch = Batch.model_validate(obj, strict=True)
    assert batch.object == "batch" and batch.status == status and batch.id.startswith("batch_")
    # Fields OpenAI always fills: none may be None here, even where the SDK allows it.
    assert batch.endpoint in (CHAT, COMPLETIONS)
    assert batch.input_file_id == "file-" + batch.id.removeprefix("batch_")
    assert batch.completion_window == window
    assert batch.expires_at == batch.created_at + window_s
    assert batch.model and batch.request_counts is not None and batch.usage is not None
    usage = batch.usage
    assert type(usage.input_tokens_details.cached_tokens) is int
    assert type(usage.output_tokens_details.reasoning_tokens) is int
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    counts = batch.request_counts
    assert counts.completed + counts.failed <= counts.total
    for name in STAMPS[status]:
        assert type(getattr(batch, name)) is int, name
    for name in ENDS:
        assert (getattr(batch, name) is not None) == (name in STAMPS[status]), name
    if status == "validating":  # nothing read yet
        assert batch.in_progress_at is None
        assert batch.request_counts == BatchRequestCounts(total=0, completed=0, failed=0)
    if status == "expired":
        assert batch.expired_at is not None and batch.expired_at >= batch.expires_at
    # The files: named when they exist and hold lines; their URIs stay as extra fields.
    finished = status in ("completed", "cancelled", "expired")
    assert batch.output_file_id == (f"{batch.input_file_id}-results" if finished and counts.completed else None)
    assert batch.error_file_id == (f"{batch.input_file_id}-errors" if finished and counts.failed else None)
    assert (obj["output_uri"] is not None) == finished and (obj["error_uri"] is not None) == finished
    if status == "failed":
        assert batch.errors is not None and batch.errors.object == "list" and batch.errors.data
        for error in batch.errors.data:
            assert isinstance(error, BatchError) and error.code and error.message
    else:
        assert batch.errors is None
    return batch


def _cli_json(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 0) -> dict[str, Any]:
    assert main(argv) == rc, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_status_json_validates_as_an_openai_batch_in_every_state(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(4)))

    # Just submitted (no worker: it waits in the broker), then cancelled.
    job = _cli_json(capsys, ["submit", str(path), "--model", stack.model, "--shard-size", "2", "--json"])
    check_batch(job, "in_progress")
    assert check_batch(_cli_json(capsys, ["status", job["id"], "--json"]), "in_progress").endpoint == CHAT
    check_batch(_cli_json(capsys, ["cancel", job["id"], "--json"]), "cancelled")
    cancelled = check_batch(_cli_json(capsys, ["status", job["id"], "--json"]), "cancelled")
    assert cancelled.request_counts is not None and cancelled.request_counts.total == 4

    # Completed: good lines, a line rejected at validation, a prompt the engine refuses.
    small = stack.with_values(engine_args={"num_kv_blocks": 256, "max_model_len": 48})
    long_prompt = {"custom_id": "long", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "soup " * 80}}
    rows = [*openai_lines(3, url=COMPLETIONS), b"{not json", long_prompt]
    ran = run_job(small.settings, jsonl(rows), small.model)
    done = check_batch(_cli_json(capsys, ["status", ran["id"], "--json"]), "completed")
    assert done.endpoint == COMPLETIONS and done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2)
    assert done.usage is not None and done.usage.input_tokens > 0 and done.usage.output_tokens > 0

    # Failed: an input rejected as a whole, with OpenAI's {object: list, data: [{code, message, param, line}]}.
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    failed_job = _cli_json(capsys, ["submit", str(empty), "--model", stack.model, "--json"], rc=1)
    for obj in (failed_job, _cli_json(capsys, ["status", failed_job["id"], "--json"])):
        failed = check_batch(obj, "failed")
        assert failed.endpoint == CHAT  # no request set one: the default
        assert failed.errors is not None and failed.errors.data is not None
        (error,) = failed.errors.data
        assert (error.code, error.line, error.param) == ("invalid_input", None, None)
        assert error.message is not None and "no requests" in error.message
        assert obj["errors"]["data"][0].keys() == {"code", "message", "param", "line"}
    assert main(["submit", str(empty), "--model", stack.model]) == 1
    assert "failed" in (err := capsys.readouterr().err) and "no requests" in err


def test_transient_and_expired_states_validate_as_openai_batches(embedded_stack, env, capsys) -> None:
    """The states a job passes through (``validating``, ``cancelling``, ``finalizing``) and
    ``expired``, each reached through the real control plane and read with ``status --json``."""
    stack = env(embedded_stack.with_values(min_completion_window_seconds=1))

    def status(job_id: str) -> dict[str, Any]:
        return _cli_json(capsys, ["status", job_id, "--json"])

    with Client(stack.settings) as client:
        # validating: an input already in the store (an upload) that no worker has read yet.
        client.store.put_bytes("uploads/in.jsonl", jsonl(openai_lines(2)))
        uri = client.store.uri("uploads/in.jsonl")
        job, _ = create_job(client.db, client.store, client.settings, uri, SubmitOptions(model=stack.model))
        check_batch(job, "validating")
        check_batch(status(job["id"]), "validating")

        # cancelling: cancelled while a worker holds a shard's lease (it must stop first).
        job = client.submit(jsonl(openai_lines(4)), stack.model, shard_size=2, enqueue=False)
        assert acquire_lease(client.db, job["id"], 0, "worker-a", ttl=60)
        check_batch(_cli_json(capsys, ["cancel", job["id"], "--json"]), "cancelling")
        check_batch(status(job["id"]), "cancelling")

        # finalizing: every shard done, a finaliser has claimed the job and not yet ended it.
        job = client.submit(jsonl(openai_lines(2)), stack.model, enqueue=False)
        assert acquire_lease(client.db, job["id"], 0, "worker-a", ttl=60)
        assert release_lease(client.db, job["id"], 0, "worker-a", ShardStatus.completed)
        assert claim_finalization(client.db, job["id"])
        check_batch(status(job["id"]), "finalizing")

        # expired: its window passed with nothing run; every request is a batch_expired error.
        job = client.submit(jsonl(openai_lines(3)), stack.model, completion_window="1s", enqueue=False)
        time.sleep(max(0.0, job["expires_at"] + 1 - time.time()))
        expired = check_batch(status(job["id"]), "expired", window="1s", window_s=1)
        assert expired.request_counts == BatchRequestCounts(total=3, completed=0, failed=3)
        assert expired.output_file_id is None and expired.error_file_id is not None
        check_batch(client.status(job["id"]), "expired", window="1s", window_s=1)


def test_completion_window_is_recorded_with_its_expiry(embedded_stack, env, tmp_path, capsys, monkeypatch) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(1)))
    submit = ["submit", str(path), "--model", stack.model, "--json"]
    check_batch(_cli_json(capsys, submit), "in_progress")
    for window, seconds in [("7d", 7 * 24 * HOUR), ("1h", HOUR), ("30d", 30 * 24 * HOUR)]:
        job = _cli_json(capsys, [*submit, "--completion-window", window])
        check_batch(job, "in_progress", window=window, window_s=seconds)
    with Client(stack.settings) as client:
        job = client.submit(path, stack.model, completion_window="48h", enqueue=False)
        check_batch(client.status(job["id"]), "in_progress", window="48h", window_s=48 * HOUR)
    for bad in ("24", "0h", "31d", "721h", "1w", "h", "1.5h", "-1h", " 24h", "24H", ""):
        assert main([*submit, f"--completion-window={bad}"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("conveyor: error: completion window must be") and repr(bad) in err, err
        assert "Traceback" not in err

    monkeypatch.setenv("CONVEYOR_COMPLETION_WINDOW", "2h")
    check_batch(_cli_json(capsys, submit), "in_progress", window="2h", window_s=2 * HOUR)
    monkeypatch.setenv("CONVEYOR_COMPLETION_WINDOW", "forever")
    assert main(["status", "batch_" + "0" * 32]) == 1
    err = capsys.readouterr().err
    assert "invalid settings: CONVEYOR_COMPLETION_WINDOW" in err and "'forever'" in err


def test_the_endpoint_is_the_first_requests_and_plain_rows_may_mix(embedded_stack) -> None:
    messages = {"messages": [{"role": "user", "content": "hi"}]}
    with Client(embedded_stack.settings) as client:

        def submit(rows: list[Any]) -> Batch:
            return check_batch(client.submit(jsonl(rows), embedded_stack.model, enqueue=False), "in_progress")

        assert submit([{"prompt": "a plain prompt"}, messages]).endpoint == COMPLETIONS
        assert submit([messages, {"prompt": "a plain prompt"}]).endpoint == CHAT
        # OpenAI Batch lines fix it by their url, even on a line rejected for its body.
        bad_body = {"custom_id": "b", "method": "POST", "url": COMPLETIONS, "body": {"prompt": ""}}
        assert submit([bad_body, *openai_lines(1, url=COMPLETIONS)]).endpoint == COMPLETIONS
        # No line names one: the chat endpoint, and the job completes with nothing to run.
        nothing = client.submit(b"nope\n", embedded_stack.model, enqueue=False)
        assert check_batch(nothing, "completed").endpoint == CHAT


def test_metadata_follows_openais_rules(embedded_stack) -> None:
    with Client(embedded_stack.settings) as client:
        job = client.submit(jsonl(openai_lines(1)), embedded_stack.model, metadata={"team": "soup"}, enqueue=False)
        assert check_batch(job, "in_progress").metadata == {"team": "soup"}
        cases: list[tuple[dict[str, Any], str]] = [
            ({"n": 1}, "'metadata.n': expected a string, but got int"),
            ({"k" * 65: "v"}, "maximum length 64, but got a key with length 65"),
            ({"k": "v" * 513}, "'metadata.k': string too long. Expected a string with maximum length 512"),
            ({f"k{i}": "v" for i in range(17)}, "at most 16 properties, but got an object with 17"),
        ]
        for bad, words in cases:
            with pytest.raises(ValueError, match=words):
                client.submit(jsonl(openai_lines(1)), embedded_stack.model, metadata=bad, enqueue=False)


# ---- output lines ---------------------------------------------------------------------------


def _file_lines(path: Path, *, results: bool) -> list[BatchRequestOutput]:
    return [check_output_line(text, results=results) for text in path.read_text().splitlines()]


def _error_code(line: BatchRequestOutput) -> tuple[str, int | None, str]:
    """(custom_id, status code or None, error code) of an errors-file line."""
    if line.response is not None:
        return line.custom_id, line.response.status_code, line.response.body["error"]["code"]
    assert line.error is not None
    return line.custom_id, None, line.error.code


def test_results_and_errors_files_follow_openais_batch_output_format(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack.with_values(engine_args={"num_kv_blocks": 256, "max_model_len": 48}))
    good = openai_lines(3)
    rows = [
        good[0],
        b"{not json",  # 2: unparseable: its custom_id is its line number
        good[1],
        {"custom_id": "nobody", "method": "POST", "url": CHAT},  # 4: no body
        {**good[2], "custom_id": "hot", "body": {**good[2]["body"], "temperature": 9}},  # 5: rejected value
        {**good[2], "custom_id": "long", "body": {"messages": [{"role": "user", "content": "soup " * 80}]}},
        b"[1, 2]",  # 7: not an object
        good[2],
        {"prompt": "a plain row", "max_tokens": 4, "temperature": 0},  # 9: a completion, custom_id line-9
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(rows))
    out, err = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    assert main(["run", str(path), "--model", stack.model, "-o", str(out), "--errors", str(err), "-q"]) == 0
    job_id = capsys.readouterr().err.split()[0]  # the summary starts with the job id

    results = _file_lines(out, results=True)
    assert [r.custom_id for r in results] == ["req-0", "req-1", "req-2", "line-9"]
    assert [r.response.body["object"] for r in results if r.response] == ["chat.completion"] * 3 + ["text_completion"]
    errors = _file_lines(err, results=False)
    assert [_error_code(e) for e in errors] == [  # in input-line order
        ("line-2", None, "invalid_json"),
        ("nobody", None, "missing_prompt"),
        ("hot", None, "invalid_value"),
        ("long", 400, "prompt_too_long"),  # issue 41: its own code
        ("line-7", None, "invalid_request"),
    ]
    by_id = {e.custom_id: e for e in errors}
    assert by_id["line-2"].error is not None and by_id["line-2"].error.line == 2
    nobody = by_id["nobody"].error
    assert nobody is not None and (nobody.param, nobody.line) == ("body", 4)
    assert nobody.message == "a request needs a body with a prompt or messages"
    assert by_id["hot"].error is not None and by_id["hot"].error.param == "temperature"
    long_response = by_id["long"].response
    assert long_response is not None and "prompt is" in long_response.body["error"]["message"]
    assert len({line.id for line in results + errors}) == len(results) + len(errors)

    assert main(["results", job_id, "--errors"]) == 0  # what `conveyor results` prints: the same file
    assert capsys.readouterr().out == err.read_text()


class _ExplodingHost:
    """An engine host that fails every request it is given (a server-side fault)."""

    def __init__(self) -> None:
        self.pid, self.alive, self.tokenizer = os.getpid(), True, None

    def submit(self, prompt, params, *, priority=0, deadline=None, tag=None, on_done=None, owner="") -> RequestHandle:
        future: Future = Future()
        future.set_exception(RuntimeError("the engine exploded"))
        handle = RequestHandle(f"r{id(tag)}", future, tag)
        if on_done is not None:
            on_done(handle)
        return handle

    def abort(self, handle: RequestHandle) -> None:
        pass

    def close(self) -> None:
        pass


def test_requests_the_server_fails_get_a_5xx_response_with_a_server_error(embedded_stack) -> None:
    with Client(embedded_stack.settings) as client:
        job = client.submit(jsonl(openai_lines(3)), embedded_stack.model, shard_size=4, enqueue=False)
        ctx = WorkerContext.create(embedded_stack.settings, host_factory=_ExplodingHost)
        try:
            outcome = run_shard(ctx, job["id"], 0)
        except RetryShard:
            pytest.fail("a request the engine fails must not fail its shard")
        finally:
            ctx.close()
        assert outcome.status == "completed" and outcome.finalized
        lines = [check_output_line(data.decode(), results=False) for data in client.result_bytes(job["id"], True)]
        assert [_error_code(line) for line in lines] == [(f"req-{i}", 500, "engine_error") for i in range(3)]
        assert all(line.response and "exploded" in line.response.body["error"]["message"] for line in lines)
