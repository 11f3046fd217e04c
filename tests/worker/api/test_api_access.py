"""The HTTP API's rules, through the ``openai`` SDK over real HTTP: keys and who sees what,
OpenAI's errors and status codes, list pages, upload limits. No batch needs to run here, so a
worker is only registered as serving the model (``workers`` rows), none is started."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from conveyor.worker.store.objects.factory import open_store_from_settings
from tests.worker.api_batches import CHAT, batch_lines, check_api_batch, raw_batch
from tests.worker.api_server import upload
from tests.worker.helpers import jsonl, wait_for


def test_keys_see_only_their_own_files_and_batches(server) -> None:
    alice, bob = server.client(server.new_key("alice")), server.client(server.new_key("bob"))
    file_id = upload(alice, batch_lines(2))
    batch = alice.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    assert alice.files.retrieve(file_id).id == file_id and alice.batches.retrieve(batch.id).id == batch.id

    for call in (
        lambda: bob.files.retrieve(file_id),
        lambda: bob.files.content(file_id),
        lambda: bob.files.delete(file_id),
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h"),
        lambda: bob.files.list(after=file_id).data,
        lambda: bob.batches.list(after=batch.id).data,
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        _error(caught.value)
    assert bob.files.list().data == [] and bob.batches.list().data == []
    assert [f.id for f in alice.files.list()] == [file_id]
    assert [b.id for b in alice.batches.list()] == [batch.id]
    # Still all there for alice: bob's delete and cancel did nothing.
    assert alice.batches.retrieve(batch.id).status == "validating"


def test_a_cancel_answers_cancelling_at_once_and_the_batch_then_ends_cancelled(server) -> None:
    alice = server.client(server.new_key("alice"))
    batch = alice.batches.create(input_file_id=upload(alice, batch_lines(2)), endpoint=CHAT, completion_window="24h")
    answer = alice.batches.cancel(batch.id)  # the files are written after the answer, not before
    assert answer.status == "cancelling" and answer.cancelling_at is not None and answer.cancelled_at is None
    wait_for(lambda: alice.batches.retrieve(batch.id).status == "cancelled", 30, "the cancel to finish")
    done = alice.batches.retrieve(batch.id)
    assert done.cancelled_at is not None and done.request_counts is not None and done.request_counts.completed == 0
    assert alice.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes


def test_a_missing_wrong_or_revoked_key_gets_401(server, env, embedded_stack, capsys) -> None:
    from conveyor.worker.entrypoints.cli import main

    key = server.new_key("carol")
    assert server.client(key).files.list().data == []
    for bad in ("sk-conveyor-nope", key + "x", key[:-1]):
        with pytest.raises(openai.AuthenticationError) as caught:
            server.client(bad).files.list()
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        assert key not in str(caught.value.body) and bad not in str(caught.value.body)
    for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"}):
        answer = httpx.get(f"{server.url}/v1/batches", headers=headers)
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
        assert answer.json()["error"]["type"] == "invalid_request_error"
    env(embedded_stack)  # (the same CONVEYOR_HOME as the server's)
    assert main(["keys", "revoke", "carol"]) == 0

    def refused() -> bool:
        try:
            server.client(key).files.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, 5, "the revoked key to be refused (a server may take it for 2 s more)")
    # No key is needed for the probes.
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/readyz")  # terse without a key: the checks may name hosts and ports
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    capsys.readouterr()


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    return body


def test_batch_creation_is_refused_with_400_naming_the_parameter(server) -> None:
    client = server.client(server.new_key("dave"))
    good = upload(client, batch_lines(2))

    def refused(expected_param: str | None, code: str | None = None, **kwargs: Any) -> dict[str, Any]:
        args = {"input_file_id": good, "endpoint": CHAT, "completion_window": "24h", **kwargs}
        with pytest.raises(openai.BadRequestError) as caught:
            client.batches.create(**args)
        error = _error(caught.value)
        assert error["param"] == expected_param, error
        if code is not None:
            assert error["code"] == code, error
        return error

    assert "/v1/moderations" in refused("endpoint", endpoint="/v1/moderations")["message"]
    refused("completion_window", completion_window="2 weeks")
    refused("metadata", metadata={f"k{i}": "v" for i in range(17)})
    refused("metadata", metadata={"k": "v" * 513})
    refused("input_file_id", extra_body={"input_file_id": None})
    refused("output_expires_after.seconds", output_expires_after={"anchor": "created_at", "seconds": 60})
    mixed = upload(client, [*batch_lines(2), *batch_lines(1, model="other-model", prefix="o")])
    message = refused("input_file_id", "mixed_models", input_file_id=mixed)["message"]
    assert "'tiny-chat'" in message and "'other-model'" in message
    completions = upload(client, batch_lines(2, url="/v1/completions"))
    refused("input_file_id", "mismatched_endpoint", input_file_id=completions)
    unserved = upload(client, batch_lines(2, model="nobody-serves-this"))
    assert "'tiny-chat'" in refused("model", "model_not_found", input_file_id=unserved)["message"]
    refused("input_file_id", "empty_file", input_file_id=upload(client, [b"", b"  "]))
    refused("input_file_id", "missing_model", input_file_id=upload(client, [b"{not json", {"prompt": "hi"}]))
    refused("input_file_id", input_file_id=upload(client, batch_lines(1), purpose="user_data"))
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-" + "0" * 32, endpoint=CHAT, completion_window="24h")
    # A bad JSON body, and one too large.
    answer = httpx.post(
        f"{server.url}/v1/batches", content=b"{nope", headers={"Authorization": f"Bearer {client.api_key}"}
    )
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
    huge = {"input_file_id": good, "endpoint": CHAT, "completion_window": "24h", "pad": "x" * 100_000}
    answer = httpx.post(f"{server.url}/v1/batches", json=huge, headers={"Authorization": f"Bearer {client.api_key}"})
    assert answer.status_code == 413
    # What is refused leaves no batch behind; a good request still works.
    assert client.batches.list().data == []
    ok = client.batches.create(input_file_id=good, endpoint=CHAT, completion_window="24h")
    check_api_batch(raw_batch(client, ok.id))


def test_an_idempotency_key_finds_the_batch_it_created(server) -> None:
    client = server.client(server.new_key("erin"))
    file_id = upload(client, batch_lines(1))
    args: dict[str, Any] = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    first = client.batches.create(**args, extra_headers={"Idempotency-Key": "k1"})
    again = client.batches.create(**args, extra_headers={"Idempotency-Key": "k1"})
    other = client.batches.create(**args, extra_headers={"Idempotency-Key": "k2"})
    assert first.id == again.id != other.id
    assert len(client.batches.list().data) == 2
    # The key names one request: the same key with another field is a conflict, not that batch.
    with pytest.raises(openai.ConflictError) as info:
        client.batches.create(**{**args, "metadata": {"run": "2"}}, extra_headers={"Idempotency-Key": "k1"})
    assert info.value.code == "idempotency_key_reused" and first.id in info.value.message
    assert "metadata" in info.value.message
    assert len(client.batches.list().data) == 2


def test_lists_page_with_after_cursors_as_openais_do(server) -> None:
    client = server.client(server.new_key("frank"))
    ids = [upload(client, batch_lines(1), name=f"f{i}.jsonl") for i in range(5)]
    newest_first = ids[::-1]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == newest_first[:2] and page.has_more
    raw = httpx.get(
        f"{server.url}/v1/files", params={"limit": 2}, headers={"Authorization": f"Bearer {client.api_key}"}
    ).json()
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == (
        "list", newest_first[0], newest_first[1], True,
    )  # fmt: skip
    assert [f.id for f in client.files.list(limit=2)] == newest_first  # the SDK follows the cursor
    assert [f.id for f in client.files.list(limit=2, order="asc")] == ids
    assert [f.id for f in client.files.list(after=ids[2], order="asc")] == ids[3:]
    assert [f.id for f in client.files.list(purpose="user_data")] == []
    last = client.files.list(limit=5)
    assert not last.has_more

    batches = [client.batches.create(input_file_id=i, endpoint=CHAT, completion_window="24h").id for i in ids[:3]]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == batches[::-1][:2] and page.has_more
    assert [b.id for b in client.batches.list(limit=2)] == batches[::-1]
    assert [b.id for b in client.batches.list(after=batches[1])] == batches[:1]
    for bad in ({"limit": 0}, {"limit": 101}, {"limit": "x"}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.batches.list(**bad)
        assert _error(caught.value)["param"] == "limit"
    with pytest.raises(openai.BadRequestError):
        client.files.list(order="sideways")


@pytest.mark.parametrize("server", [{"max_upload_bytes": 1 << 20}], indirect=True)
def test_an_upload_over_the_limit_gets_413_and_leaves_nothing(server) -> None:
    client = server.client(server.new_key("gina"))
    line = jsonl(batch_lines(1))
    big = line * (3 * (1 << 20) // len(line))  # 3 MB of good lines
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", big), purpose="batch")
    assert caught.value.status_code == 413 and _error(caught.value)["code"] == "file_too_large"

    # Without a Content-Length (chunked), the limit is counted while the body streams in.
    boundary = "conveyor-test-boundary"

    def body() -> Iterator[bytes]:
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'.encode()
        for start in range(0, len(big), 65536):
            yield big[start : start + 65536]
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {"Authorization": f"Bearer {client.api_key}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    answer = httpx.post(f"{server.url}/v1/files", content=body(), headers=headers, timeout=60)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "file_too_large"
    store = open_store_from_settings(server.settings)
    assert list(store.list("files/")) == []  # nothing kept of either
    assert client.files.list().data == []
    # Just under the limit is taken.
    fits = big[: (1 << 20) - 10_000]
    fits = fits[: fits.rindex(b"\n") + 1]
    assert client.files.create(file=("fits.jsonl", fits), purpose="batch").bytes == len(fits)


def test_upload_form_mistakes_get_400(server) -> None:
    client = server.client(server.new_key("hal"))
    auth = {"Authorization": f"Bearer {client.api_key}"}
    url = f"{server.url}/v1/files"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"files": {"file": ("a.jsonl", b"{}\n")}}, "purpose"),
        ({"data": {"purpose": "batch"}, "files": {"other": ("a.jsonl", b"{}\n")}}, "file"),
        ({"data": {"purpose": "fine-tune"}, "files": {"file": ("a.jsonl", b"{}\n")}}, "purpose"),
        ({"data": {"purpose": "batch"}, "files": {"file": ("x" * 300, b"{}\n")}}, "file"),
        ({"data": {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "5"},
          "files": {"file": ("a.jsonl", b"{}\n")}}, "expires_after.seconds"),
    ]  # fmt: skip
    for kwargs, param in cases:
        answer = httpx.post(url, headers=auth, **kwargs)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    answer = httpx.post(url, headers=auth, json={"purpose": "batch"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_content_type"
    assert client.files.list().data == []
    # expires_after is kept as expires_at.
    kept = client.files.create(
        file=("a.jsonl", b"{}\n"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert kept.expires_at == kept.created_at + 3600
    # Unknown paths and methods answer in OpenAI's shape too.
    assert httpx.get(f"{server.url}/v1/nothing", headers=auth).json()["error"]["message"].startswith("Invalid URL")
    assert httpx.put(f"{server.url}/v1/files", headers=auth).status_code == 405


@pytest.mark.parametrize("server", [{"upload_idle_timeout_seconds": 1.0}], indirect=True)
def test_an_upload_that_stalls_mid_body_gets_408_and_frees_its_slot(server) -> None:
    client = server.client(server.new_key("ida"))
    host, port = server.url.removeprefix("http://").split(":")
    boundary = "conveyor-stall"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="s.jsonl"\r\n\r\n'
    ).encode() + jsonl(batch_lines(3))
    request = (
        f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {client.api_key}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(head) + 100_000}\r\n\r\n"
    ).encode() + head
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)  # ... and then nothing more: the client hangs mid-body
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert time.monotonic() - started < 15
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 408 " in status_line, answer[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "upload_timeout"
    assert client.files.list().data == []
    assert list(open_store_from_settings(server.settings).list("files/")) == []
    assert upload(client, batch_lines(1))  # the slot is free again
