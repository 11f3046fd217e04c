"""The HTTP API against a careless or hostile client (issue 22's medium and low findings), over
real HTTP on raw sockets where a well-behaved client library would not misbehave: a declared
over-limit length, uploads that trickle, one key holding every upload slot."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from tests.worker.api_batches import batch_lines
from tests.worker.api_server import ApiServer, upload
from tests.worker.helpers import jsonl

BOUNDARY = "conveyor-hardening"


def _head(api: ApiServer, key: str, length: int, extra: str = "") -> bytes:
    host = api.url.removeprefix("http://")
    return (
        f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {length}\r\n{extra}\r\n"
    ).encode()


def _form_start() -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="s.jsonl"\r\n\r\n'
    ).encode()


def _connect(api: ApiServer) -> socket.socket:
    host, port = api.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _answer(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while not (b"\r\n\r\n" in data and data.rstrip().endswith(b"}")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def _trickle(sock: socket.socket, every: float, seconds: float) -> tuple[int, dict[str, Any]]:
    """Send one byte every ``every`` s until the server answers (or ``seconds`` pass)."""
    sock.settimeout(every)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"x")
        except OSError:
            break
        try:
            if sock.recv(1, socket.MSG_PEEK):
                break
        except TimeoutError:
            continue
    sock.settimeout(10)
    return _answer(sock)


def test_a_declared_over_limit_length_is_answered_413_before_any_body(server) -> None:
    key = server.new_key("declared")
    with _connect(server) as sock:
        sock.sendall(_head(server, key, 10 << 30, "Expect: 100-continue\r\n"))  # 10 GiB announced, none sent
        sock.settimeout(10)
        status, body = _answer(sock)
    assert status == 413 and body["error"]["code"] == "file_too_large"


@pytest.mark.parametrize(
    "server", [{"upload_idle_timeout_seconds": 1.0, "upload_min_bytes_per_second": 1000}], indirect=True
)
def test_an_upload_trickling_a_byte_at_a_time_is_dropped(server) -> None:
    key = server.new_key("slowloris")
    with _connect(server) as sock:
        sock.sendall(_head(server, key, 1_000_000) + _form_start())
        started = time.monotonic()
        status, body = _trickle(sock, 0.25, 30)  # a byte every 0.25 s: never idle for 1 s
    assert time.monotonic() - started < 10
    assert status == 408 and body["error"]["code"] == "upload_timeout"
    assert "CONVEYOR_UPLOAD_MIN_BYTES_PER_SECOND" in body["error"]["message"]


@pytest.mark.parametrize(
    "server", [{"upload_idle_timeout_seconds": 1.0, "upload_min_bytes_per_second": 0, "upload_max_seconds": 2.0}],
    indirect=True,
)  # fmt: skip
def test_no_upload_outlasts_its_deadline(server) -> None:
    key = server.new_key("forever")
    with _connect(server) as sock:
        sock.sendall(_head(server, key, 1_000_000) + _form_start())
        started = time.monotonic()
        status, body = _trickle(sock, 0.25, 30)
    assert 1.5 < time.monotonic() - started < 10
    assert status == 408 and "CONVEYOR_UPLOAD_MAX_SECONDS" in body["error"]["message"]


@pytest.mark.parametrize("server", [{"max_concurrent_uploads_per_key": 1}], indirect=True)
def test_one_key_cannot_hold_every_upload_slot(server) -> None:
    mallory, alice = server.new_key("mallory"), server.new_key("alice")
    with _connect(server) as held:
        held.sendall(_head(server, mallory, 1_000_000) + _form_start() + jsonl(batch_lines(1)))  # and waits
        time.sleep(0.5)
        with _connect(server) as second:
            second.sendall(_head(server, mallory, len(_form_start())) + _form_start())
            second.settimeout(10)
            status, body = _answer(second)
        assert status == 429 and "CONVEYOR_MAX_CONCURRENT_UPLOADS_PER_KEY" in body["error"]["message"]
        assert upload(server.client(alice), batch_lines(1))  # another key still uploads


def test_a_nul_in_metadata_is_a_400_naming_it(server) -> None:
    """PostgreSQL refuses NUL in JSONB (it was a 500 there): refused before it reaches the database."""
    import openai

    from tests.worker.api_batches import CHAT

    client = server.client(server.new_key("nul"))
    file_id = upload(client, batch_lines(1))
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"k": "a\x00b"})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "metadata" and "NUL" in error["message"]
    assert client.batches.list().data == []


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` within ``seconds`` without answering."""
    sock.settimeout(seconds)
    try:
        return sock.recv(65536) == b""
    except TimeoutError:
        return False


@pytest.mark.parametrize("server", [{"http_header_timeout_seconds": 1.0}], indirect=True)
def test_a_connection_that_never_finishes_its_headers_is_closed(server) -> None:
    host = server.url.removeprefix("http://")
    with _connect(server) as sock:
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode())  # ... and no more
        assert _closed_within(sock, 10)
    with _connect(server) as sock:  # the same after a first request on a kept-alive connection
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while b'{"status":"ok"}' not in data:
            data += sock.recv(65536)
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n".encode())
        assert _closed_within(sock, 10)


@pytest.mark.parametrize("server", [{"http_body_timeout_seconds": 1.0}], indirect=True)
def test_a_json_body_that_never_arrives_is_a_408(server) -> None:
    host, key = server.url.removeprefix("http://"), server.new_key("slow-json")
    with _connect(server) as sock:
        sock.sendall(
            f"POST /v1/batches HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"input_file_id": '.encode()
        )
        sock.settimeout(10)
        status, body = _answer(sock)
    assert status == 408 and "CONVEYOR_HTTP_BODY_TIMEOUT_SECONDS" in body["error"]["message"]


def test_a_form_of_many_empty_parts_is_refused(server) -> None:
    key = server.new_key("parts")
    empty = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n\r\n'.encode()
    body = empty * 1000 + f"--{BOUNDARY}--\r\n".encode()
    with _connect(server) as sock:
        sock.sendall(_head(server, key, len(body)) + body)
        sock.settimeout(10)
        status, answer = _answer(sock)
    assert status == 400 and "more than 16 parts" in answer["error"]["message"]


def test_a_workers_metrics_server_drops_half_sent_requests(tmp_path) -> None:
    from prometheus_client import CollectorRegistry

    from conveyor.worker.metrics.server import MetricsServer

    metrics = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, request_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", metrics.port), timeout=30) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            assert _closed_within(sock, 10)
    finally:
        metrics.close()


TOKEN = "scraper-token-0123456789"


@pytest.mark.parametrize("server", [{"metrics_token": TOKEN}], indirect=True)
def test_metrics_and_readiness_detail_need_a_token_or_a_key(server) -> None:
    import httpx2 as httpx
    from prometheus_client import CollectorRegistry

    from conveyor.worker.metrics.server import MetricsServer

    anonymous = httpx.get(f"{server.url}/metrics")
    assert anonymous.status_code == 401 and "database" not in anonymous.text
    scraped = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert scraped.status_code == 200 and "conveyor_jobs" in scraped.text
    # /readyz: ready or not to anyone (a probe holds no key), each check's detail to a key holder.
    assert httpx.get(f"{server.url}/readyz").json() == {"status": "ready"}
    key = server.new_key("operator")
    detail = httpx.get(f"{server.url}/readyz", headers={"Authorization": f"Bearer {key}"}).json()
    assert detail["checks"] == {"database": "ok", "broker": "ok", "storage": "ok"}
    metrics = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, token=TOKEN)  # a worker's, the same way
    try:
        assert httpx.get(f"http://127.0.0.1:{metrics.port}/metrics").status_code == 401
        headers = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"http://127.0.0.1:{metrics.port}/metrics", headers=headers).status_code == 200
    finally:
        metrics.close()


def test_a_server_without_keys_answers_only_loopback_json_requests(embedded_stack) -> None:
    import httpx2 as httpx

    from tests.worker.api_batches import CHAT

    keyless = ApiServer(embedded_stack.settings, insecure=True).start()
    try:
        url = f"{keyless.url}/v1/batches"
        rebound = httpx.get(url, headers={"Host": "attacker.example:8000"})  # DNS rebinding
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden_host"
        page = httpx.post(url, headers={"Origin": "https://attacker.example"}, json={})  # a page's fetch
        assert page.status_code == 403 and page.json()["error"]["code"] == "forbidden_origin"
        blind = httpx.post(url, content=b'{"input_file_id": "file-x"}', headers={"Content-Type": "text/plain"})
        assert blind.status_code == 415 and blind.json()["error"]["code"] == "unsupported_media_type"
        form = httpx.post(url, data={"input_file_id": "file-x"})  # an HTML form's encoding
        assert form.status_code == 415
        # The SDK, on loopback, works as before.
        client = keyless.client(None)
        file_id = upload(client, batch_lines(1))
        assert client.files.retrieve(file_id).id == file_id
        assert httpx.get(f"http://localhost:{keyless.port}/healthz").status_code == 200
        assert client.batches.list().data == [] and CHAT
    finally:
        keyless.stop()
