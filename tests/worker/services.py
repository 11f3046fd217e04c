"""Where the tests find the machine's services, and what a test does when one is down.

Shared by the fixtures in ``conftest.py`` and by tests that talk to a service directly.
"""

from __future__ import annotations

import os
import socket
from typing import NoReturn

import pytest

# The machine's PostgreSQL; the standard libpq variables may point elsewhere.
PG_HOST = os.environ.get("PGHOST", "127.0.0.1")
PG_PORT = int(os.environ.get("PGPORT", "5432"))
PG_DB = os.environ.get("PGDATABASE", "test")
PG_USERS = tuple(filter(None, (os.environ.get("PGUSER"), "postgres", "root")))

REDIS_URL = os.environ.get("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("CONVEYOR_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def service_down(name: str, detail: str) -> NoReturn:
    message = f"SERVICE DOWN: {name} is not available ({detail})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; CI=true requires it", pytrace=False)
    pytest.skip(f"{message}; start it (e.g. `bash .ci/services.sh`) to run these tests")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
