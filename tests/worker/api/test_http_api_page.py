"""The HTTP API page (docs/user-guide/http-api.md) lists every route `conveyor serve` answers and
every limit with the default it runs with: the routes are compared with a running server's
OpenAPI schema (and its routes kept out of the schema, probed), the limits with its settings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx2 as httpx

from conveyor.worker.core.settings import Settings
from tests.worker.helpers import REPO, _die_with_parent
from tests.worker.services import free_port

PAGE = REPO / "docs/user-guide/http-api.md"
ROUTE_ROW = re.compile(r"^\| `(GET|POST|DELETE|PUT|PATCH) (/[^`]*)` \|", re.MULTILINE)
LIMIT_ROW = re.compile(r"^\| `CONVEYOR_([A-Z0-9_]+)` \| ([\d,]+)", re.MULTILINE)
# Settings that bound what a user sends or holds: each must have a row. Those left out bound
# other doors (the CLI's `--shard-size` and `--priority`, the broker's messages, the splitter).
LIMIT_NAME = re.compile(r"^(max_|batch_max_|message_batch_max_|quota_|upload_|http_|default_max_tokens$)")
NOT_THE_API = {"max_shard_size", "max_priority", "max_message_bytes", "max_shards_per_job"}
# Routes the schema leaves out, as FastAPI does: the schema itself, and the metrics page.
OUTSIDE_THE_SCHEMA = {("GET", "/openapi.json"), ("GET", "/metrics")}


def section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    [body] = re.findall(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.DOTALL | re.MULTILINE)
    return body


def documented_routes() -> set[tuple[str, str]]:
    return {(method, path) for method, path in ROUTE_ROW.findall(section("Every route"))}


def documented_limits() -> dict[str, int]:
    return {name.lower(): int(value.replace(",", "")) for name, value in LIMIT_ROW.findall(section("Every limit"))}


def test_every_route_a_running_server_answers_is_on_the_page(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= {"CONVEYOR_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    port = free_port()
    argv = [sys.executable, "-m", "conveyor.worker.entrypoints.cli", "serve", "--insecure-no-auth"]
    server = subprocess.Popen(
        [*argv, "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                schema = httpx.get(f"{url}/openapi.json", timeout=5)
                break
            except httpx.TransportError:
                assert server.poll() is None, server.communicate()[1]
                assert time.monotonic() < deadline, "conveyor serve did not come up"
                time.sleep(0.2)
        assert schema.status_code == 200
        served = {(m.upper(), path) for path, ops in schema.json()["paths"].items() for m in ops}
        for method, path in OUTSIDE_THE_SCHEMA:
            assert method == "GET" and httpx.get(f"{url}{path}", timeout=5).status_code == 200, path
        assert documented_routes() == served | OUTSIDE_THE_SCHEMA
        # The list pages' bounds the page states are the server's.
        params = {
            path: {p["name"]: p["schema"] for p in ops["get"].get("parameters", [])}
            for path, ops in schema.json()["paths"].items()
            if "get" in ops
        }
        routes = section("Every route")
        for path in ("/v1/files", "/v1/batches", "/v1/messages/batches"):
            bounds = params[path]["limit"]
            [row] = [line for line in routes.splitlines() if line.startswith(f"| `GET {path}` |")]
            assert f"`limit` {bounds['minimum']} to {bounds['maximum']:,}" in row, row
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_every_limit_is_on_the_page_with_the_default_the_server_runs_with(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)
    settings = Settings()
    documented = documented_limits()
    limits = {name for name in Settings.model_fields if LIMIT_NAME.match(name) and name not in NOT_THE_API}
    assert limits - documented.keys() == set(), "limits missing from the page"
    for name, value in documented.items():
        assert name in Settings.model_fields, f"CONVEYOR_{name.upper()} is no setting"
        assert getattr(settings, name) == value, name
