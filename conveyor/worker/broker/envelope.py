"""A task message's Celery envelope, checked before Celery's own request trusts it.

Celery's worker takes a protocol-2 envelope on trust: a message whose body is not
``[args, kwargs, embed]``, or whose headers have no ``id``, raises inside its consumer loop
and stops the whole worker ("Unrecoverable error"); with late acks the message goes back
onto the queue and stops the next worker to take it as well. The submission queue is open
to producers outside Conveyor, so every Conveyor task reads its messages through
``CheckedRequest``: it turns such a message into Celery's ``InvalidTaskError``, which Celery
logs and rejects (the message is dropped, or dead-lettered where the queue has a
dead-letter exchange) before it goes on with the next one.

The same check keeps the worker to running jobs and nothing else: a message over
``CONVEYOR_MAX_MESSAGE_BYTES``, one with an ``eta``/``countdown`` (Celery would hold it in the
worker's memory until then, however many come) or an ``expires``, and one whose embed asks
for callbacks, errbacks, a chain or a chord (the worker would send further messages for a
publisher) are refused the same way. Conveyor itself sends none of these.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import InvalidTaskError
from celery.worker.request import Request

REQUEST = "conveyor.worker.broker.envelope:CheckedRequest"  # what a task's ``Request`` option names
MAX_BYTES_OPTION = "conveyor_max_message_bytes"  # the app's conf key holding the size limit


def header_problem(headers: Any) -> str | None:
    """What is wrong with a protocol-2 message's headers for Celery (None when nothing is)."""
    if not isinstance(headers, dict):
        return "its headers are not an object"
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not task_id:
        return "its headers have no 'id' (the task id, a string)"
    timelimit = headers.get("timelimit")
    if timelimit and not (
        isinstance(timelimit, (list, tuple))
        and len(timelimit) == 2
        and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in timelimit)
    ):
        return "its 'timelimit' header is not [soft, hard] (numbers or null)"
    retries = headers.get("retries", 0)
    if isinstance(retries, bool) or not isinstance(retries, int):
        return "its 'retries' header is not an integer"
    for name in ("eta", "expires"):
        if headers.get(name) is not None:
            return f"it has an '{name}' header (Conveyor's queues take no delayed or expiring messages)"
    return None


def body_problem(payload: Any) -> str | None:
    """What is wrong with a protocol-2 message's (decoded) body (None when nothing is)."""
    if not isinstance(payload, (list, tuple)) or len(payload) != 3:
        return "its body is not [args, kwargs, embed]"
    args, kwargs, embed = payload
    if not isinstance(args, (list, tuple)):
        return "its args are not a list"
    if not isinstance(kwargs, dict):
        return "its kwargs are not an object"
    if embed is not None and not isinstance(embed, dict):
        return "its embed (callbacks, errbacks, chain, chord) is not an object"
    asked = sorted(name for name, value in (embed or {}).items() if value)
    if asked:
        return f"its embed asks for {', '.join(asked)} (Conveyor's tasks take no callbacks, chains or chords)"
    return None


def size_problem(body: Any, limit: int | None) -> str | None:
    """What is wrong with the size of a message's raw body (None when nothing is)."""
    size = len(body) if isinstance(body, (bytes, bytearray, str, memoryview)) else 0
    if limit is not None and size > limit:
        return f"its body is {size} bytes, over the limit of {limit} (CONVEYOR_MAX_MESSAGE_BYTES)"
    return None


class CheckedRequest(Request):
    """Celery's request, for a message whose envelope was checked first."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        headers = message.headers if kwargs.get("headers") is None else kwargs["headers"]
        payload = kwargs.get("body") if kwargs.get("decoded") else message.payload  # (a DecodeError: Celery's)
        task = kwargs.get("task")
        limit = getattr(task.app.conf, MAX_BYTES_OPTION, None) if task is not None else None
        problem = size_problem(message.body, limit) or header_problem(headers) or body_problem(payload)
        if problem is not None:
            raise InvalidTaskError(f"malformed task message: {problem}")
        try:
            super().__init__(message, *args, **kwargs)
        except InvalidTaskError:
            raise
        except Exception as exc:  # anything else Celery trips on while reading the envelope
            raise InvalidTaskError(f"malformed task message: {type(exc).__name__}: {exc}") from exc
