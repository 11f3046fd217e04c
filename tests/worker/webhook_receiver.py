"""A local HTTPS webhook receiver for the tests: a real TLS server on 127.0.0.1 with a
self-signed certificate made here (``cryptography``), which the sender trusts through
``CONVEYOR_WEBHOOK_CA_BUNDLE``. It records every request (path, headers, body) and answers
from a script per path (status codes in turn, then 200; a redirect with its ``Location``)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from openai.types.webhooks import (
    BatchCancelledWebhookEvent,
    BatchCompletedWebhookEvent,
    BatchExpiredWebhookEvent,
    BatchFailedWebhookEvent,
)


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when it came


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for ``localhost`` and 127.0.0.1, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "receiver-cert.pem", folder / "receiver-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


class Receiver:
    def __init__(self, folder: Path) -> None:
        self.cert, key = self_signed_cert(folder)
        self.received: list[Received] = []
        self.script: dict[str, list[int]] = {}  # path -> status codes to answer in turn
        self.redirects: dict[str, str] = {}  # path -> Location (answered 307)
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver._lock:
                    receiver.received.append(
                        Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic())
                    )
                    codes = receiver.script.get(self.path) or []
                    code = codes.pop(0) if codes else 200
                location = receiver.redirects.get(self.path)
                self.send_response(307 if location else code)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"https://{host}:{self.port}{path}"

    def at(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path == path]

    def wait_for(self, path: str, count: int = 1, timeout: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.at(path)
            if len(got) >= count:
                return got
            time.sleep(0.05)
        raise AssertionError(f"{path}: {len(self.at(path))} deliveries after {timeout} s, wanted {count}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(tmp_path) -> Iterator[Receiver]:
    r = Receiver(tmp_path)
    yield r
    r.close()


BatchEvent = (
    BatchCompletedWebhookEvent | BatchFailedWebhookEvent | BatchCancelledWebhookEvent | BatchExpiredWebhookEvent
)


def unwrap_batch_event(received: Received, secret: str) -> BatchEvent:
    """The delivery as the ``openai`` SDK reads it: ``unwrap`` raises unless the signature
    verifies under ``secret``; the event must be one of the four batch events."""
    sdk = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1", webhook_secret=secret)
    event = sdk.webhooks.unwrap(received.body, received.headers)
    assert isinstance(
        event,
        (BatchCompletedWebhookEvent, BatchFailedWebhookEvent, BatchCancelledWebhookEvent, BatchExpiredWebhookEvent),
    ), event
    return event
