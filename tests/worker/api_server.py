"""The HTTP API served by uvicorn on a free port, in a thread of the test process, for the
``openai`` SDK (or plain httpx) to call over real HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import uvicorn

from conveyor.worker.api.app import create_app
from conveyor.worker.api.http_server import uvicorn_options
from conveyor.worker.core.settings import Settings
from conveyor.worker.store.api_keys import create_key
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import WorkerState
from conveyor.worker.store.schema import ensure_schema
from conveyor.worker.store.workers import register_worker, set_worker_state
from tests.worker.api_batches import MODEL
from tests.worker.helpers import jsonl
from tests.worker.services import free_port


class ApiServer:
    def __init__(self, settings: Settings, *, insecure: bool = False) -> None:
        self.settings = settings
        self._migrate()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings, insecure=insecure)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", **uvicorn_options(settings)
        )  # as ``conveyor serve`` runs it
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="api-server", daemon=True)

    def start(self, timeout: float = 30.0) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError("the API server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, key: str | None, **kwargs: Any) -> openai.OpenAI:
        """The official SDK pointed at this server (no retries: a test sees each answer)."""
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", **kwargs)

    def _migrate(self) -> None:
        if self.settings.is_embedded:
            self.settings.ensure_home()
        db = create_db_engine(self.settings.database)
        try:
            ensure_schema(self.settings, db)  # the embedded database is migrated, a server's checked
        finally:
            db.dispose()

    def new_key(self, name: str) -> str:
        db = create_db_engine(self.settings.database)
        try:
            return create_key(db, name)[1]
        finally:
            db.dispose()


@pytest.fixture
def serve():
    """``serve(stack, **setting overrides)`` starts the API on a free port; stopped after."""
    servers: list[ApiServer] = []

    def start(stack, *, insecure: bool = False, **overrides: Any) -> ApiServer:
        server = ApiServer(stack.with_values(**overrides).settings, insecure=insecure).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[ApiServer]:
    """The API over an embedded stack (or the stack a test names with ``@pytest.mark.parametrize``
    through ``indirect``), with a live worker registered for MODEL."""
    overrides: dict[str, Any] = getattr(request, "param", {})
    stack = request.getfixturevalue("embedded_stack").with_values(**overrides)
    api = ApiServer(stack.settings).start()
    db = create_db_engine(stack.settings.database)
    set_worker_state(db, register_worker(db, MODEL, "q", checkpoint=stack.model), WorkerState.ready)
    db.dispose()
    yield api
    api.stop()


def upload(client: openai.OpenAI, rows: list[Any], name: str = "in.jsonl", purpose: str = "batch") -> str:
    return client.files.create(file=(name, jsonl(rows)), purpose=purpose).id  # type: ignore[arg-type]  # (a purpose the SDK's Literal may not list)
