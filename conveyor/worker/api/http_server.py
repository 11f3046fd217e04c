"""How ``conveyor serve`` runs its app under uvicorn: connections that must send their
headers in time.

uvicorn times out an idle keep-alive connection, but not one that opened and sends its
request line and headers slowly, or never finishes them: a few hundred such connections
were held open for good. ``HeaderTimeoutH11Protocol`` closes a connection whose request's
headers are not all in ``CONVEYOR_HTTP_HEADER_TIMEOUT_SECONDS`` after it opened (or after the
previous response). Once the headers are in, the app runs, and bodies have their own limits
(``read_json_body``, the uploads' pace).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from conveyor.worker.core.settings import Settings


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        inner = self.app

        async def app(scope: Any, receive: Any, send: Any) -> None:
            self._disarm()  # uvicorn calls the app once the request's headers are complete
            await inner(scope, receive, send)

        self.app = app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` that bound a connection."""
    protocol = type(
        "HeaderTimeout", (HeaderTimeoutH11Protocol,), {"header_timeout": settings.http_header_timeout_seconds}
    )
    return {"http": protocol, "timeout_keep_alive": settings.http_keep_alive_seconds}
