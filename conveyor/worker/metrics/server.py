"""A worker's small HTTP server on a daemon thread: ``/metrics`` (``prometheus_client``'s own
WSGI app: text or OpenMetrics by the scraper's ``Accept`` header, gzip when asked) and, when
given checks, ``/healthz`` (liveness) and ``/readyz`` (readiness), each 200 or 503 with a
small JSON body saying why."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from conveyor.worker.metrics.token import token_matches

# A health check: (healthy, what to say about it).
HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]

_Environ = dict[str, Any]
_StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _IPv6Server(_ThreadingServer):
    address_family = socket.AF_INET6


REQUEST_TIMEOUT_SECONDS = 10.0  # a connection silent this long mid-request is closed (its thread ends)


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_SECONDS  # half-sent requests must not pile up threads

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no log line each
        pass


class MetricsServer:
    """Serves ``registry`` on ``host:port`` from construction until ``close()``. Port 0 takes
    a free port (``port`` says which). ``OSError`` if the address cannot be bound."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        liveness: HealthCheck | None = None,
        readiness: HealthCheck | None = None,
        request_timeout: float = REQUEST_TIMEOUT_SECONDS,
        token: str | None = None,
    ) -> None:
        routes: dict[str, Callable[[_Environ, _StartResponse], Iterable[bytes]]] = {
            "/metrics": _guarded(make_wsgi_app(registry), token)
        }
        if liveness is not None:
            routes["/healthz"] = _health_app(liveness)
        if readiness is not None:
            routes["/readyz"] = _health_app(readiness)

        def app(environ: _Environ, start_response: _StartResponse) -> Iterable[bytes]:
            route = routes.get(environ.get("PATH_INFO") or "/")
            if route is None:
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [f"not found; this server answers {', '.join(sorted(routes))}\n".encode()]
            return route(environ, start_response)

        server_class = _IPv6Server if ":" in host else _ThreadingServer
        handler = type("_Handler", (_QuietHandler,), {"timeout": request_timeout})
        self._server = make_server(host, port, app, server_class, handler_class=handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="conveyor-metrics", daemon=True)
        self._thread.start()
        self.host = host
        self.port: int = self._server.server_port

    def close(self, timeout: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)


def _health_app(check: HealthCheck) -> Callable[[_Environ, _StartResponse], Iterable[bytes]]:
    def app(environ: _Environ, start_response: _StartResponse) -> Iterable[bytes]:
        try:
            ok, detail = check()
        except Exception as exc:  # a check that raises says "unhealthy", with why
            ok, detail = False, {"status": "check failed", "error": f"{type(exc).__name__}: {exc}"[:500]}
        body = json.dumps(detail, default=str).encode()
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return app


def _guarded(
    app: Callable[[_Environ, _StartResponse], Iterable[bytes]], token: str | None
) -> Callable[[_Environ, _StartResponse], Iterable[bytes]]:
    """``app`` for a scraper sending ``token`` (``CONVEYOR_METRICS_TOKEN``) only, when one is set."""

    def guarded(environ: _Environ, start_response: _StartResponse) -> Iterable[bytes]:
        if not token_matches(token, environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"the metrics need the scraper's token (CONVEYOR_METRICS_TOKEN)\n"]
        return app(environ, start_response)

    return guarded
