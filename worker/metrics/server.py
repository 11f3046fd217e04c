"""A ``/metrics`` HTTP server on a daemon thread (``prometheus_client``'s own: text or
OpenMetrics by the scraper's ``Accept`` header, gzip when asked)."""

from __future__ import annotations

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry


class MetricsServer:
    """Serves ``registry`` on ``host:port`` from construction until ``close()``. Port 0 takes
    a free port (``port`` says which). ``OSError`` if the address cannot be bound."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self._server.server_port

    def close(self, timeout: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)
