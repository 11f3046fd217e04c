"""Errors on Anthropic's routes in Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``, with the status codes the ``anthropic`` SDK maps to its exception classes (400
``BadRequestError``, 401 ``AuthenticationError``, 404 ``NotFoundError``, 413, 429
``RateLimitError``, 5xx ``InternalServerError``).

``AnthropicRoute`` (a router's ``route_class``) answers whatever its routes and their
dependencies raise this way: the app's handlers keep OpenAI's shape for every other route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError
from starlette.requests import Request
from starlette.responses import Response

from conveyor.worker.api.errors import ApiError, validation_error
from conveyor.worker.jobs.lifecycle import JobNotFound
from conveyor.worker.jobs.object_keys import InvalidJobId
from conveyor.worker.store.objects.base import StorageUnavailable

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
}  # fmt: skip


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def answer(exc: Exception) -> JSONResponse:
    """The error response for ``exc`` raised by a route or a dependency of Anthropic's."""
    if isinstance(exc, (RequestValidationError, ValidationError)):
        exc = validation_error(list(exc.errors()))
    if isinstance(exc, ApiError):
        return anthropic_error(exc.status, exc.message, exc.headers)
    if isinstance(exc, (JobNotFound, InvalidJobId)):
        return anthropic_error(404, str(exc))
    if isinstance(exc, (StorageUnavailable, OperationalError)):
        log.warning("answering 503: %s", exc)
        what = "the database" if isinstance(exc, OperationalError) else "the object store"
        return anthropic_error(503, f"The server cannot reach {what} right now; try again shortly.")
    log.error("unexpected error", exc_info=exc)
    return anthropic_error(500, "The server had an error while processing your request.")


class AnthropicRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return answer(exc)

        return route
