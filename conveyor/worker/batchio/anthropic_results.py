"""A Message Batch's results lines (``MessageBatchIndividualResponse``): ``{"custom_id",
"result"}`` with a result of type ``succeeded`` (the ``Message``), ``errored`` (Anthropic's error
response), ``canceled`` or ``expired``, read from the job's OpenAI-shaped output lines.

The worker already wrote each succeeded line's body as the ``Message``
(``conveyor.worker.batchio.anthropic_message``); here only the envelope changes, so results can
be served line by line from the job's files as they stream.
"""

from __future__ import annotations

from typing import Any

from conveyor.worker.batchio.output_lines import BATCH_CANCELLED, BATCH_EXPIRED

INVALID_REQUEST = "invalid_request_error"
API_ERROR = "api_error"


def error_response(kind: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id}


def individual_response(line: dict[str, Any]) -> dict[str, Any]:
    """The results line of one results-file or errors-file line of the job."""
    custom_id = line["custom_id"]
    response = line.get("response")
    if line.get("error") is not None:  # never ran: rejected at validation, or left by expiry or a cancel
        error = line["error"]
        if error.get("code") == BATCH_EXPIRED:
            return unrun_response(custom_id, "expired")
        if error.get("code") == BATCH_CANCELLED:
            return unrun_response(custom_id, "canceled")
        return errored_response(custom_id, INVALID_REQUEST, str(error.get("message") or "invalid request"))
    status = response.get("status_code", 500) if isinstance(response, dict) else 500
    body = response.get("body") if isinstance(response, dict) else None
    if status == 200 and isinstance(body, dict):
        return {"custom_id": custom_id, "result": {"type": "succeeded", "message": body}}
    error = body.get("error") if isinstance(body, dict) else None
    message = str((error or {}).get("message") or "the request failed")
    request_id = response.get("request_id") if isinstance(response, dict) else None
    return errored_response(custom_id, INVALID_REQUEST if status < 500 else API_ERROR, message, request_id)


def errored_response(custom_id: str, kind: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    return {"custom_id": custom_id, "result": {"type": "errored", "error": error_response(kind, message, request_id)}}


def unrun_response(custom_id: str, kind: str) -> dict[str, Any]:
    """A request that never ran: ``canceled`` or ``expired``."""
    return {"custom_id": custom_id, "result": {"type": kind}}
