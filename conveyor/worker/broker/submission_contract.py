"""Broker-level submission: the message that submits a job, checked field by field.

Any producer that can publish a Celery protocol-2 JSON message (in any language; the
README shows one written with plain kombu, without importing conveyor) submits a job by
reference to an input already in the object store:

- task ``conveyor.submit_job`` on the queue ``<CONVEYOR_QUEUE_PREFIX>-submit``
  (``conveyor.worker.broker.queues.submit_queue_name``), which every worker consumes, whatever
  model it serves;
- keyword arguments only (``args`` is ``[]``), the fields below (``SUBMISSION_FIELDS``):

  ============================  =========================================================
  ``input_uri`` (required)      the input, an object under the configured store
                                (``CONVEYOR_STORAGE_URL``): ``s3://bucket/prefix/...`` or
                                ``file:///dir/...``; anything else is refused
  ``model`` (required)          a hub id or a local directory, as ``conveyor submit --model``
  ``idempotency_key`` (required)  1 to 256 printable characters naming this submission: a
                                message sent again with the same key (a retry, a broker's
                                redelivery) finds the job the first one created
  ``metadata``                  OpenAI's rules: at most 16 string pairs, keys up to 64
                                characters, values up to 512
  ``completion_window``         ``"24h"`` (default ``CONVEYOR_COMPLETION_WINDOW``), ``1h``-``30d``
  ``priority``                  an integer from 0 to ``CONVEYOR_MAX_PRIORITY`` (default 0)
  ``shard_size``                an integer from 1 to ``CONVEYOR_MAX_SHARD_SIZE``
  ``input_format``              ``jsonl``, ``csv`` or ``parquet`` (default: detected)
  ``reply_to``                  where to announce the job's end (``check_reply_to``): a
                                queue name, ``{"queue": name}``, or ``{"exchange": name,
                                "routing_key": key, "type": "direct" | "topic"}``
  ``chat``                      ``true``/``false``: plain ``prompt`` rows through the
                                model's chat template (default null: when it has one)
  ``system_prompt``             a system message first in every chat request without one
  ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``n``,
  ``response_format``           defaults under each line's own fields (OpenAI's body
                                fields, checked as a line's are)
  ============================  =========================================================

The request options (``chat`` to ``response_format``) are ``Client.submit``'s keywords and
``conveyor submit``'s flags, by the same names (``conveyor.worker.batchio.request_options``).

A message that breaks the contract is never retried and never stops the worker: it is
refused (``InvalidSubmission``, naming the field), logged, and acknowledged. When its
``idempotency_key`` is itself valid, the refusal is also recorded as a ``failed`` job (its
``errors`` say why: code ``invalid_submission``, ``param`` the field), announced to its
``reply_to`` (when that is valid too) like any job's end, so the producer hears back; a
message sent again with that key finds that failed job (a corrected message needs a new
key). A message whose Celery envelope is malformed never reaches this module
(``conveyor.worker.broker.envelope``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.batchio.request_options import OPTION_FIELDS, RequestOptions
from conveyor.worker.core.limits import completion_window_seconds
from conveyor.worker.core.settings import Settings
from conveyor.worker.core.storable_text import UnstorableText, check_storable
from conveyor.worker.jobs.catalog import not_served
from conveyor.worker.jobs.model_names import InvalidModel, canonical_model
from conveyor.worker.jobs.submission import HTTP_KEY_NAMESPACE, check_metadata
from conveyor.worker.store.models import IDEMPOTENCY_KEY_LEN, URI_LEN

REQUIRED = ("input_uri", "model", "idempotency_key")
OPTIONAL = ("metadata", "completion_window", "priority", "shard_size", "input_format", "reply_to", *OPTION_FIELDS)
SUBMISSION_FIELDS = REQUIRED + OPTIONAL

# Names a reply target may use: what RabbitMQ, Redis and SQS (kombu maps '.' and ':') accept.
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
_ROUTING_KEY = re.compile(r"^[A-Za-z0-9_.:#*-]{0,255}$")
EXCHANGE_TYPES = ("direct", "topic")
_PRINTABLE = re.compile(r"^[\x20-\x7e]+$")


class InvalidSubmission(ValueError):
    """A submission message that breaks the contract. ``param`` names the field at fault;
    ``idempotency_key`` and ``reply_to`` are the message's own when they were valid (the
    refusal can then be recorded and announced)."""

    code = "invalid_submission"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        idempotency_key: str | None = None,
        reply_to: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.param = param
        self.idempotency_key = idempotency_key
        self.reply_to = reply_to


@dataclass(frozen=True)
class Submission:
    input_uri: str
    model: str  # canonical
    idempotency_key: str
    metadata: dict[str, str] | None = None
    completion_window: str | None = None
    priority: int = 0
    shard_size: int | None = None
    input_format: InputFormat | None = None  # None: detected from the input
    reply_to: dict[str, Any] | None = None  # normalised (``check_reply_to``)
    request_options: RequestOptions = field(default_factory=RequestOptions)


def _reserved(name: str, queue_prefix: str) -> bool:
    return name.startswith("amq.") or name == queue_prefix or name.startswith((f"{queue_prefix}-", f"{queue_prefix}."))


def check_reply_to(value: Any, queue_prefix: str, allowed_prefix: str = "") -> dict[str, Any]:
    """A reply target, normalised to ``{"queue": name}`` or ``{"exchange": name, "type": t,
    "routing_key": key}``; ``ValueError`` saying what is wrong. Names are 1 to 200 letters,
    digits, ``_ . : -``; a routing key up to 255 of those and ``# *``. Conveyor's own queues
    (names starting with ``<CONVEYOR_QUEUE_PREFIX>-``) and ``amq.*`` are refused, and with an
    ``allowed_prefix`` (``CONVEYOR_REPLY_TO_PREFIX``) every name not starting with it, so a
    producer cannot have announcements published into another application's queue."""
    if isinstance(value, str):
        value = {"queue": value}
    kind, name = _reply_target(value)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"reply_to {kind} must be 1 to 200 letters, digits, '_', '.', ':' or '-', got {name!r:.80}")
    if _reserved(name, queue_prefix):
        raise ValueError(f"reply_to {kind} {name!r} is reserved (amq.* or one of Conveyor's own, {queue_prefix}-*)")
    if not name.startswith(allowed_prefix):
        raise ValueError(f"reply_to {kind} {name!r} must start with {allowed_prefix!r} (CONVEYOR_REPLY_TO_PREFIX)")
    if kind == "queue":
        return {"queue": name}
    return _exchange_target(value, name)


def _reply_target(value: Any) -> tuple[str, Any]:
    """``("queue", name)`` or ``("exchange", name)``: what a reply target names, its fields checked."""
    if not isinstance(value, dict):
        raise ValueError(
            "reply_to must be a queue name or an object: {'queue': name} or "
            f"{{'exchange': name, 'routing_key': key, 'type': 'direct'}}, got {type(value).__name__}"
        )
    if "queue" in value:
        extra = set(value) - {"queue"}
        if extra:
            raise ValueError(f"reply_to names a queue; it takes no {', '.join(sorted(map(str, extra)))}")
        return "queue", value["queue"]
    if "exchange" in value:
        extra = set(value) - {"exchange", "routing_key", "type"}
        if extra:
            raise ValueError(f"reply_to has unknown fields: {', '.join(sorted(map(str, extra)))}")
        return "exchange", value["exchange"]
    raise ValueError("reply_to must name a 'queue' or an 'exchange'")


def _exchange_target(value: dict[str, Any], name: str) -> dict[str, Any]:
    """An exchange target with its routing key and exchange type checked."""
    routing_key = value.get("routing_key", "")
    if not isinstance(routing_key, str) or not _ROUTING_KEY.match(routing_key):
        raise ValueError(
            f"reply_to routing_key must be up to 255 letters, digits, '_', '.', ':', '-', '#' or '*', "
            f"got {routing_key!r:.80}"
        )
    kind_of = value.get("type", "direct")
    if kind_of not in EXCHANGE_TYPES:
        raise ValueError(f"reply_to type must be one of {', '.join(EXCHANGE_TYPES)}, got {kind_of!r:.40}")
    return {"exchange": name, "type": kind_of, "routing_key": routing_key}


def check_idempotency_key(value: Any) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= IDEMPOTENCY_KEY_LEN or not _PRINTABLE.match(value):
        raise ValueError(
            f"idempotency_key must be a string of 1 to {IDEMPOTENCY_KEY_LEN} printable ASCII characters, "
            f"got {value!r:.80}"
        )
    if value.startswith(HTTP_KEY_NAMESPACE):  # the HTTP API's: a producer must not take a tenant's key
        raise ValueError(f"idempotency_key must not start with {HTTP_KEY_NAMESPACE!r} (the HTTP API's keys)")
    return value


def _check_uri(value: Any) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= URI_LEN or not _PRINTABLE.match(value):
        raise ValueError(
            f"input_uri must be a URI of 1 to {URI_LEN} printable ASCII characters "
            f"(s3://bucket/key or file:///path, under the object store), got {value!r:.80}"
        )
    return value


def _check_int(name: str, value: Any, low: int, high: int, setting: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high} ({setting}), got {value!r:.40}")
    return value


def parse_submission(args: Any, kwargs: Any, settings: Settings) -> Submission:
    """The submission a message carries (``args`` and ``kwargs`` of its Celery body),
    every field checked; ``InvalidSubmission`` naming the first field at fault."""
    if not isinstance(kwargs, dict):
        raise InvalidSubmission("the message's kwargs must be an object")
    key, target = _answer_fields(kwargs, settings)

    def refuse(message: str, param: str | None = None) -> InvalidSubmission:
        return InvalidSubmission(message, param=param, idempotency_key=key, reply_to=target)

    _check_fields(args, kwargs, refuse)
    assert key is not None
    values: dict[str, Any] = {}
    field = "input_uri"
    try:
        for field, check in _FIELD_CHECKS:
            values[field] = check(kwargs, settings)
        for field in OPTION_FIELDS:  # each alone first, so a refusal names the field at fault
            if kwargs.get(field) is not None:
                RequestOptions.from_fields(**{field: kwargs[field]}).check(settings.input_limits())
        options = RequestOptions.from_fields(**{name: kwargs.get(name) for name in OPTION_FIELDS})
        field = "request options"
        values["request_options"] = options.check(settings.input_limits())
    except ValueError as exc:
        raise refuse(f"{field}: {exc}" if not str(exc).startswith(field) else str(exc), field) from None
    return Submission(idempotency_key=key, reply_to=target, **values)


def _answer_fields(kwargs: dict[str, Any], settings: Settings) -> tuple[str | None, dict[str, Any] | None]:
    """The two fields that let a refusal be answered, checked first: the idempotency key and the
    reply target (None when not given)."""
    key: str | None = None
    try:
        raw_key = kwargs.get("idempotency_key")
        key = None if raw_key is None else check_idempotency_key(raw_key)
    except ValueError as exc:
        raise InvalidSubmission(str(exc), param="idempotency_key") from None
    try:
        raw_target = kwargs.get("reply_to")
        target = (
            None if raw_target is None else check_reply_to(raw_target, settings.queue_prefix, settings.reply_to_prefix)
        )
    except ValueError as exc:
        raise InvalidSubmission(str(exc), param="reply_to", idempotency_key=key) from None
    return key, target


def _check_fields(args: Any, kwargs: dict[str, Any], refuse: Callable[[str, str | None], InvalidSubmission]) -> None:
    """Keyword arguments only, each a known field, the required ones given, every value
    storable (before any of them is looked up or stored)."""
    if args:
        raise refuse("conveyor.submit_job takes keyword arguments only (the message's args must be [])", None)
    unknown = sorted(str(k) for k in kwargs if k not in SUBMISSION_FIELDS)
    if unknown:
        raise refuse(
            f"unknown field(s) {', '.join(unknown)[:200]}; the fields are {', '.join(SUBMISSION_FIELDS)}", unknown[0]
        )
    for name in REQUIRED:
        if kwargs.get(name) is None:
            raise refuse(f"{name} is required", name)
    for name, value in kwargs.items():
        try:
            check_storable(value, name)
        except UnstorableText as exc:
            raise refuse(str(exc), exc.field) from None


def _model(kwargs: dict[str, Any], _settings: Settings) -> str:
    try:
        return canonical_model(kwargs["model"])
    except InvalidModel:  # said as for any model not served: no oracle on a worker's paths
        raise ValueError(not_served(kwargs["model"])) from None


def _completion_window(kwargs: dict[str, Any], settings: Settings) -> str | None:
    window = kwargs.get("completion_window")
    if window is not None:
        completion_window_seconds(window, settings.min_completion_window_seconds)
    return window


def _priority(kwargs: dict[str, Any], settings: Settings) -> int:
    priority = kwargs.get("priority")
    if priority is None:
        return 0
    return _check_int("priority", priority, 0, settings.max_priority, "CONVEYOR_MAX_PRIORITY")


def _shard_size(kwargs: dict[str, Any], settings: Settings) -> int | None:
    size = kwargs.get("shard_size")
    if size is None:
        return None
    return _check_int("shard_size", size, 1, settings.max_shard_size, "CONVEYOR_MAX_SHARD_SIZE")


def _input_format(kwargs: dict[str, Any], _settings: Settings) -> InputFormat | None:
    fmt = kwargs.get("input_format")
    if fmt is not None and fmt not in {f.value for f in InputFormat}:
        raise ValueError(f"input_format must be one of {', '.join(f.value for f in InputFormat)}, got {fmt!r:.40}")
    return None if fmt is None else InputFormat(fmt)


# A submission's fields in the order they are checked (a refusal names the first at fault), each
# with its check: the value to keep, or ``ValueError``.
_FIELD_CHECKS: tuple[tuple[str, Callable[[dict[str, Any], Settings], Any]], ...] = (
    ("input_uri", lambda kwargs, _settings: _check_uri(kwargs["input_uri"])),
    ("model", _model),
    ("metadata", lambda kwargs, _settings: check_metadata(kwargs.get("metadata"))),
    ("completion_window", _completion_window),
    ("priority", _priority),
    ("shard_size", _shard_size),
    ("input_format", _input_format),
)
