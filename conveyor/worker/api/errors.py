"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the status
codes the ``openai`` SDK maps to its exception classes: 400 ``BadRequestError``, 401
``AuthenticationError``, 404 ``NotFoundError``, 409 ``ConflictError``, 413 (``APIStatusError``),
422 ``UnprocessableEntityError``, 429 ``RateLimitError`` (which the SDK retries), 5xx
``InternalServerError``.

Request validation (a missing or mistyped field, an unknown one) is a 400 naming the field in
``param``, as OpenAI answers it, not FastAPI's 422. Errors of the lower layers (an unknown
job or file, storage or database down) are mapped here once, so routes raise what they meet.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.worker.core.storable_text import UnstorableText
from conveyor.worker.jobs.files import FileNotFound
from conveyor.worker.jobs.lifecycle import JobNotFound
from conveyor.worker.jobs.object_keys import InvalidJobId
from conveyor.worker.store.objects.base import StorageUnavailable

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

_TYPES = {401: INVALID_REQUEST, 429: "rate_limit_error"}


class ApiError(Exception):
    """An error answered as ``status`` with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or (SERVER_ERROR if status >= 500 else _TYPES.get(status, INVALID_REQUEST))
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str, *, param: str | None = None) -> ApiError:
    return ApiError(404, message, param=param)


def response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def validation_error(errors: list[Any]) -> ApiError:
    """pydantic's errors as OpenAI's 400: the first problem, its field as ``param``."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request. The body must be a JSON object.", code="invalid_json"
        )
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = f"Invalid value for '{param}': " if param else "Invalid request: "
    return bad_request(where + message, param=param, code="invalid_value" if param else None)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return response(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (RequestValidationError, ValidationError))
        return response(validation_error(list(exc.errors())))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
        else:
            message = str(exc.detail)
        return response(ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    async def on_unstorable(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, UnstorableText)
        return response(bad_request(str(exc), param=exc.field, code="invalid_value"))

    async def on_not_found(_: Request, exc: Exception) -> JSONResponse:
        return response(not_found(str(exc)))

    async def on_unavailable(_: Request, exc: Exception) -> JSONResponse:
        log.warning("answering 503: %s", exc)
        what = "the database" if isinstance(exc, OperationalError) else "the object store"
        return response(ApiError(503, f"The server cannot reach {what} right now; try again shortly."))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error", exc_info=exc)
        return response(ApiError(500, "The server had an error while processing your request."))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(UnstorableText, on_unstorable)
    for missing in (FileNotFound, JobNotFound, InvalidJobId):
        app.add_exception_handler(missing, on_not_found)
    for down in (StorageUnavailable, OperationalError):
        app.add_exception_handler(down, on_unavailable)
    app.add_exception_handler(Exception, on_unexpected)
