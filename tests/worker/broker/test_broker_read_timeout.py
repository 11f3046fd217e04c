"""A RabbitMQ that stops answering without closing the connection (gone behind a load
balancer, a partition, a node that hangs): a worker's synchronous call to it, such as the
``basic_qos`` Celery sends when its prefetch changes, fails after
``CONVEYOR_BROKER_READ_TIMEOUT`` instead of waiting forever, so Celery drops the connection
and makes a new one. The broker is the machine's RabbitMQ behind a proxy that silences the
connections open at the moment."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from conveyor.worker.broker.config import celery_app, transport_options
from conveyor.worker.core.settings import Settings
from tests.worker.services import AMQP_URL
from tests.worker.tcp_proxy import TcpProxy

READ_TIMEOUT = 2.0


def _settings(broker: str, read_timeout: float = 60.0) -> Settings:
    return Settings(broker_url=broker, broker_read_timeout=read_timeout)


def test_a_call_the_broker_never_answers_fails_after_the_read_timeout(amqp_broker) -> None:
    proxy = TcpProxy("127.0.0.1", int(AMQP_URL.rsplit(":", 1)[1].split("/")[0]))
    url = f"amqp://guest:guest@{proxy.url_host()}//"
    conn = celery_app(_settings(url, READ_TIMEOUT), "conveyor-read-timeout").connection_for_read()
    outcome: list[BaseException | None] = []
    try:
        channel = conn.default_channel
        channel.basic_qos(0, 1, False)  # answered while the broker talks
        proxy.silence()

        def call() -> None:
            try:
                channel.basic_qos(0, 2, False)
                outcome.append(None)
            except BaseException as exc:  # what the call raised is the result
                outcome.append(exc)

        started = time.monotonic()
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(READ_TIMEOUT * 10)
        took = time.monotonic() - started
    finally:
        proxy.close()  # resets the silenced connection: closing it cannot wait on the broker
        with contextlib.suppress(Exception):
            conn.release()
    assert outcome, f"basic_qos still waits for the silent broker after {took:.0f} s"
    assert isinstance(outcome[0], OSError), outcome  # socket.timeout: a connection error to Celery
    assert isinstance(outcome[0], tuple(conn.connection_errors))
    assert took >= READ_TIMEOUT * 0.9


@pytest.mark.parametrize(
    ("broker", "read_timeout"),
    [("amqp://h//", 60.0), ("amqps://h//", 60.0), ("pyamqp://h//", 60.0), ("redis://h/0", None)],
)
def test_only_amqp_connections_get_a_read_timeout(broker: str, read_timeout: float | None) -> None:
    assert transport_options(_settings(broker)).get("read_timeout") == read_timeout
