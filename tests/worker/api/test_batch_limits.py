"""OpenAI's Batch API limits at ``POST /v1/batches``, through the official ``openai`` SDK: requests
per file, bytes per file, an embeddings batch's inputs in all, ``metadata``'s shape and
``output_expires_after``'s bounds, each refused with OpenAI's 400 naming the parameter and
code; an operator's larger limits apply instead. The limits are set small here, so that a file
of a few lines reaches them."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from sqlalchemy import update

from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import StoredFile
from tests.worker.api_batches import CHAT, MODEL, batch_lines
from tests.worker.api_server import upload
from tests.worker.helpers import jsonl

EMBEDDINGS = "/v1/embeddings"
LIMITS = {"batch_max_requests": 3, "batch_max_file_bytes": 4000, "batch_max_embedding_inputs": 5}


def embedding_line(i: int, value: Any) -> dict[str, Any]:
    return {"custom_id": f"e{i}", "method": "POST", "url": EMBEDDINGS, "body": {"model": MODEL, "input": value}}


def refusal(client: openai.OpenAI, file_id: str, endpoint: str = CHAT, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h", **kwargs)  # type: ignore[arg-type]  # (the SDK's Literal endpoints)
    body = caught.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    assert body["type"] == "invalid_request_error"
    return body


def test_a_file_past_openais_limits_is_refused_with_their_codes(embedded_stack, serve) -> None:
    server = serve(embedded_stack, models=[MODEL], **LIMITS)
    client = server.client(server.new_key("erin"))

    four = upload(client, batch_lines(4))
    error = refusal(client, four)
    assert (error["param"], error["code"]) == ("input_file_id", "too_many_requests")
    assert f"{four} holds 4 requests" in error["message"] and "at most 3 requests" in error["message"]
    assert "CONVEYOR_BATCH_MAX_REQUESTS" in error["message"]

    padded = batch_lines(2)
    padded[0]["body"]["messages"][0]["content"] = "x" * 4000
    big = client.files.retrieve(upload(client, padded))
    error = refusal(client, big.id)
    assert (error["param"], error["code"]) == ("input_file_id", "file_too_large")
    assert f"is {big.bytes} bytes" in error["message"] and "at most 4000 bytes" in error["message"]

    # Every string or token array of an input list counts: 3 + 1 + 2 = 6 inputs in three lines.
    six = upload(client, [embedding_line(0, ["a", "b", "c"]), embedding_line(1, "d"), embedding_line(2, [[1, 2], [3]])])
    error = refusal(client, six, EMBEDDINGS)
    assert (error["param"], error["code"]) == ("input_file_id", "too_many_embedding_inputs")
    assert "holds 6 embedding inputs" in error["message"] and "at most 5" in error["message"]
    # A token array is one input: 1 + 1 + 3 = 5 is within the limit.
    five = upload(client, [embedding_line(0, "a"), embedding_line(1, [1, 2, 3]), embedding_line(2, ["b", "c", "d"])])
    assert (
        client.batches.create(input_file_id=five, endpoint=EMBEDDINGS, completion_window="24h").status == "validating"
    )

    # The same file within the limits is a batch; nothing refused left one behind.
    three = upload(client, batch_lines(3))
    made = client.batches.create(input_file_id=three, endpoint=CHAT, completion_window="24h")
    assert made.status == "validating"
    assert sorted(b.input_file_id for b in client.batches.list()) == sorted([five, three])


def test_an_operator_raises_the_limits(embedded_stack, serve) -> None:
    server = serve(embedded_stack, models=[MODEL], **{**LIMITS, "batch_max_requests": 5})
    client = server.client(server.new_key("erin"))
    four = upload(client, batch_lines(4))
    assert client.batches.create(input_file_id=four, endpoint=CHAT, completion_window="24h").status == "validating"
    # Every door's own limit still holds above it.
    strict = serve(embedded_stack, models=[MODEL], batch_max_requests=10, max_lines_per_job=3)
    client = strict.client(strict.new_key("frank"))
    error = refusal(client, upload(client, batch_lines(4)))
    assert error["code"] == "too_many_requests" and "CONVEYOR_MAX_LINES_PER_JOB" in error["message"]


def test_metadata_is_refused_as_openai_refuses_it(embedded_stack, serve) -> None:
    server = serve(embedded_stack, models=[MODEL])
    client = server.client(server.new_key("erin"))
    good = upload(client, batch_lines(1))

    error = refusal(client, good, metadata={f"k{i}": "v" for i in range(17)})
    assert (error["param"], error["code"]) == ("metadata", "object_above_max_properties")
    assert "at most 16 properties, but got an object with 17 properties" in error["message"]
    error = refusal(client, good, metadata={"k" * 65: "v"})
    assert (error["param"], error["code"]) == ("metadata", "string_above_max_length")
    assert "maximum length 64, but got a key with length 65" in error["message"]
    error = refusal(client, good, metadata={"k": "v" * 513})
    assert (error["param"], error["code"]) == ("metadata", "string_above_max_length")
    assert (
        "Invalid 'metadata.k'" in error["message"]
        and "maximum length 512, but got a string with length 513" in (error["message"])
    )
    # The largest metadata OpenAI takes is taken, and echoed.
    widest = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    made = client.batches.create(input_file_id=good, endpoint=CHAT, completion_window="24h", metadata=widest)
    assert made.metadata == widest


@pytest.mark.parametrize(
    ("value", "param", "code"),
    [
        ({"anchor": "created_at", "seconds": 3599}, "output_expires_after.seconds", "integer_below_min_value"),
        ({"anchor": "created_at", "seconds": 2_592_001}, "output_expires_after.seconds", "integer_above_max_value"),
        ({"anchor": "created_at", "seconds": "3600"}, "output_expires_after.seconds", "invalid_type"),
        ({"anchor": "completed_at", "seconds": 3600}, "output_expires_after.anchor", "invalid_value"),
        ({"anchor": "created_at"}, "output_expires_after.seconds", "missing_required_parameter"),
        ({"anchor": "created_at", "seconds": 3600, "days": 1}, "output_expires_after.days", None),
    ],
)
def test_output_expires_after_is_checked_as_openai_checks_it(embedded_stack, serve, value, param, code) -> None:
    server = serve(embedded_stack, models=[MODEL])
    client = server.client(server.new_key("erin"))
    error = refusal(client, upload(client, batch_lines(1)), output_expires_after=value)
    assert (error["param"], error["code"]) == (param, code), error
    assert client.batches.list().data == []


def test_an_idempotency_key_names_one_output_expiry(embedded_stack, serve) -> None:
    server = serve(embedded_stack, models=[MODEL])
    client = server.client(server.new_key("erin"))
    file_id = upload(client, batch_lines(1))
    args: dict[str, Any] = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    key = {"Idempotency-Key": "nightly-1"}
    hour = {"anchor": "created_at", "seconds": 3600}
    made = client.batches.create(**args, output_expires_after=hour, extra_headers=key)
    again = client.batches.create(**args, output_expires_after=hour, extra_headers=key)
    assert again.id == made.id
    for other in ({"anchor": "created_at", "seconds": 7200}, None):
        extra = {} if other is None else {"output_expires_after": other}
        with pytest.raises(openai.ConflictError) as caught:
            client.batches.create(**args, **extra, extra_headers=key)
        assert isinstance(caught.value.body, dict)
        assert (caught.value.body["param"], caught.value.body["code"]) == (
            "output_expires_after",
            "idempotency_key_reused",
        )
    assert [b.id for b in client.batches.list()] == [made.id]


def test_an_expired_input_file_is_a_404_that_says_so(embedded_stack, serve) -> None:
    server = serve(embedded_stack, models=[MODEL])
    client = server.client(server.new_key("erin"))
    kept = client.files.create(
        file=("in.jsonl", jsonl(batch_lines(1))),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    db = create_db_engine(server.settings.database)
    try:  # the hour passes
        with db.begin() as conn:
            conn.execute(update(StoredFile).where(StoredFile.id == kept.id).values(expires_at=time.time() - 1))
    finally:
        db.dispose()
    with pytest.raises(openai.NotFoundError) as caught:
        client.batches.create(input_file_id=kept.id, endpoint=CHAT, completion_window="24h")
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input_file_id"
    assert caught.value.body["message"].startswith(f"File {kept.id} expired at ")
