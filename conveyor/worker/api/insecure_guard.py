"""What a server without keys (``conveyor serve --insecure-no-auth``, loopback only) still
checks: that a request is meant for this machine and not sent by a web page.

A loopback address alone does not keep a browser out. A page on any site can make its
visitor's browser send requests to ``127.0.0.1`` (blind cross-site requests: a form posting
``text/plain``), or have a name it controls resolve to ``127.0.0.1`` (DNS rebinding) and then
read the answers. So, with no key asked for, a request must name a loopback ``Host``, carry
no ``Origin`` but a loopback one, and send a body only as JSON (or a multipart form to
``/v1/files``): what a browser cannot send across sites without asking first.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from conveyor.worker.api.errors import ApiError, response

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _host_name(value: str) -> str:
    """The host of a ``Host`` header or an origin's netloc, without its port."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def refusal(method: str, path: str, headers: dict[str, str]) -> ApiError | None:
    """Why a request to a keyless server is refused (None when it is not)."""
    host = _host_name(headers.get("host", ""))
    if host not in LOOPBACK_HOSTS:
        return ApiError(
            403,
            f"This server takes no API key, so it answers only requests for a loopback host "
            f"(localhost, 127.0.0.1, [::1]), not {host[:100]!r}.",
            code="forbidden_host",
        )
    origin = headers.get("origin")
    if origin is not None and _host_name(urlsplit(origin).netloc) not in LOOPBACK_HOSTS:
        return ApiError(
            403, "This server takes no API key, so it refuses requests from web pages.", code="forbidden_origin"
        )
    content_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if method in _BODY_METHODS and content_type:
        allowed = {"application/json"} | ({"multipart/form-data"} if path.rstrip("/") == "/v1/files" else set())
        if content_type not in allowed:
            return ApiError(
                415,
                f"This server takes no API key, so it takes bodies only as {' or '.join(sorted(allowed))}, "
                f"not {content_type[:80]!r}.",
                code="unsupported_media_type",
            )
    return None


class InsecureGuard:
    """ASGI middleware applying ``refusal`` to every HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            error = refusal(scope.get("method", "GET"), scope.get("path", ""), headers)
            if error is not None:
                await response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
