"""NUL and lone surrogates, which PostgreSQL's text and JSONB cannot hold, are refused at every
door with a 400 (or its door's refusal) naming the field, never a 500: the HTTP API (the
``openai`` SDK and raw HTTP), ``Client.submit`` and a broker submission, on PostgreSQL and S3."""

from __future__ import annotations

import json
from typing import Any, Final

import httpx2 as httpx
import openai
import pytest
from sqlalchemy import select

from conveyor.worker.broker.submissions import handle_submission
from conveyor.worker.core.storable_text import UnstorableText, check_storable, storable
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.models import Job
from tests.worker.helpers import jsonl, openai_lines

CHAT: Final = "/v1/chat/completions"
MODEL = "tiny-chat"
BAD = {"NUL": "\x00", "surrogate": "\ud800"}


@pytest.fixture
def api(pg_redis_s3_stack, serve):
    server = serve(pg_redis_s3_stack, models=[MODEL])
    key = server.new_key("tenant")
    client = Client(pg_redis_s3_stack.settings)
    yield server, key, client
    client.close()


def _file(**line: Any) -> bytes:
    row: dict[str, Any] = {"custom_id": "r-1", "method": "POST", "url": CHAT,
           "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip
    row.update({k: v for k, v in line.items() if k != "model"})
    if "model" in line:
        row["body"]["model"] = line["model"]
    # ensure_ascii: a lone surrogate travels as its JSON escape, as a client would send it
    return (json.dumps(row) + "\n").encode()


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize(("field", "line"), [("body.model", "model"), ("url", "url")])
def test_an_upload_naming_one_in_a_line_is_a_400_naming_the_field(api, kind: str, field: str, line: str) -> None:
    server, key, client = api
    sdk = server.client(key)
    value = {"model": f"tiny{BAD[kind]}chat", "url": f"{CHAT}{BAD[kind]}"}[line]
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(file=("in.jsonl", _file(**{line: value})), purpose="batch")
    assert caught.value.status_code == 400 and caught.value.param == f"{field}[0]"
    assert "without NUL characters or lone surrogates" in caught.value.message
    assert sdk.files.list().data == [] and list(client.store.list("files/")) == []  # nothing kept
    sdk.files.create(file=("in.jsonl", _file()), purpose="batch")  # the server is fine


@pytest.mark.parametrize("query", ["purpose=%00", "purpose=batch%00", "purpose=%00&limit=2"])
def test_listing_files_by_a_purpose_with_nul_is_a_400(api, query: str) -> None:
    server, key, _client = api
    answer = httpx.get(f"{server.url}/v1/files?{query}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "purpose"


def test_a_batch_whose_metadata_holds_nul_is_a_400(api) -> None:
    server, key, _client = api
    sdk = server.client(key)
    file_id = sdk.files.create(file=("in.jsonl", _file()), purpose="batch").id
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"team": "a\x00"})
    assert caught.value.param == "metadata" and "metadata.team must be text without NUL" in caught.value.message
    assert sdk.batches.list().data == []


@pytest.mark.parametrize("kind", list(BAD))
def test_client_submit_refuses_them_naming_the_field(api, kind: str) -> None:
    _server, _key, client = api
    rows = jsonl(openai_lines(1))
    cases = {
        "model": lambda: client.submit(rows, f"org/m{BAD[kind]}", enqueue=False),
        "metadata.team": lambda: client.submit(rows, MODEL, metadata={"team": BAD[kind]}, enqueue=False),
        "system_prompt": lambda: client.submit(rows, MODEL, system_prompt=f"be kind{BAD[kind]}", enqueue=False),
        "defaults.stop[0]": lambda: client.submit(rows, MODEL, stop=[f"x{BAD[kind]}"], enqueue=False),
    }
    for field, submit in cases.items():
        with pytest.raises(ValueError, match=r"NUL character|lone surrogate") as caught:
            submit()
        # (the sampling defaults' own check names a surrogate in ``stop`` first, as in a line)
        assert str(caught.value).startswith((field, "stop has")), (field, caught.value)
    with client.db.connect() as conn:
        assert conn.execute(select(Job.id)).all() == []


@pytest.mark.parametrize("kind", list(BAD))
def test_a_broker_submission_is_refused_naming_the_field_and_recorded(api, kind: str) -> None:
    _server, _key, client = api
    client.store.put_bytes("inputs/a.jsonl", jsonl(openai_lines(1)))
    msg = {"input_uri": client.store.uri("inputs/a.jsonl"), "model": MODEL, "idempotency_key": "k-1"}
    answers = []
    extras: list[dict[str, Any]] = [
        {"model": f"m{BAD[kind]}"}, {"metadata": {"team": BAD[kind]}}, {"system_prompt": BAD[kind]},
    ]  # fmt: skip
    for key, extra in enumerate(extras):
        answer = handle_submission(
            client.db, client.store, client.settings, [], {**msg, **extra, "idempotency_key": f"k-{key}"},
            enqueue_intake=lambda _job: None, announce=lambda _job: None,
        )  # fmt: skip
        answers.append(answer)
    fields = [a["refused"].split(" ", 1)[0] for a in answers]
    assert fields == ["model", "metadata.team", "system_prompt"]
    assert all(a["status"] == "failed" and "lone surrogates" in a["refused"] for a in answers)
    with client.db.connect() as conn:
        params = [e[0]["param"] for (e,) in conn.execute(select(Job.errors).order_by(Job.idempotency_key))]
    assert params == ["model", "metadata.team", "system_prompt"]


def test_the_check_names_the_place_and_storable_replaces() -> None:
    check_storable({"a": ["ok", {"b": "fine"}]}, "x")
    with pytest.raises(UnstorableText, match=r"^x\.a\[1\]\.b must be .* a NUL character \(\\u0000\) at character 2"):
        check_storable({"a": ["ok", {"b": "no\x00"}]}, "x")
    with pytest.raises(UnstorableText, match=r"^x key must be .* a lone surrogate \('\\udc00'") as caught:
        check_storable({"k\udc00": 1}, "x")
    assert caught.value.field == "x key"
    assert storable("a\x00b\ud800c") == "a\ufffdb\ufffdc" and storable(None) == ""
