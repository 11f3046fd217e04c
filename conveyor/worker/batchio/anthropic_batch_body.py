"""A Message Batch's create body, ``{"requests": [{"custom_id", "params"}, ...]}``, read one
request at a time, with the rules that refuse the whole batch (as Anthropic's API does):

- the body is a JSON object with ``requests`` only, a non-empty list of at most
  ``max_requests`` objects with ``custom_id`` and ``params`` only;
- each ``custom_id`` is 1 to 64 characters of ``[A-Za-z0-9_-]``, unique within the batch;
- each ``params`` is an object.

What ``params`` asks for is not judged here: a request we cannot serve is that request's
``errored`` result (``conveyor.worker.batchio.anthropic_body``), never the batch's 400. The
requests are decoded one by one from the body's text (``json.JSONDecoder.raw_decode``), so
only one request's values are held at a time besides the text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from conveyor.worker.core.limits import MAX_INTEGER_DIGITS

CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SPACE = re.compile(r"[ \t\n\r]*")


class BatchBodyError(ValueError):
    """The batch as a whole is refused; ``param`` names where (``requests.3.custom_id``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class BatchRequest:
    index: int
    custom_id: str
    params: dict[str, Any]


def _int(text: str) -> int:
    """An integer literal; one too long for ``int`` becomes one just too long for any field, so
    intake refuses the field it sits in by name (``conveyor.worker.batchio.json_values``)."""
    digits = len(text) - text.startswith("-")
    return 10**MAX_INTEGER_DIGITS if digits > MAX_INTEGER_DIGITS else int(text)


_DECODER = json.JSONDecoder(parse_int=_int)


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def skip(self) -> str:
        match = _SPACE.match(self.text, self.at)
        assert match is not None  # the pattern matches the empty string
        self.at = match.end()
        return self.text[self.at : self.at + 1]

    def expect(self, char: str, what: str) -> None:
        if self.skip() != char:
            raise BatchBodyError(f"The request body is not valid JSON: expected {what} at character {self.at}.")
        self.at += 1

    def value(self) -> Any:
        self.skip()
        try:
            value, self.at = _DECODER.raw_decode(self.text, self.at)
        except json.JSONDecodeError as exc:
            raise BatchBodyError(f"The request body is not valid JSON: {exc.msg} at character {exc.pos}.") from None
        except RecursionError:
            raise BatchBodyError("The request body is nested too deeply.") from None
        return value


def iter_batch_requests(text: str, max_requests: int) -> Iterator[BatchRequest]:
    """The batch's requests in order; ``BatchBodyError`` (possibly after some were yielded:
    the caller discards what it did with them) when the batch must be refused."""
    reader = _Reader(text)
    reader.expect("{", "a JSON object")
    seen: set[str] = set()
    count = 0
    if reader.skip() != "}":
        while True:
            key = reader.value()
            reader.expect(":", "':'")
            if key != "requests":
                raise BatchBodyError(f"{key!s:.64}: Extra inputs are not permitted", str(key)[:64])
            if count or seen:
                raise BatchBodyError("requests: given twice", "requests")
            reader.expect("[", "a list of requests")
            if reader.skip() != "]":
                while True:
                    count += 1
                    if count > max_requests:
                        raise BatchBodyError(
                            f"requests: a batch holds at most {max_requests} requests "
                            "(CONVEYOR_MESSAGE_BATCH_MAX_REQUESTS).",
                            "requests",
                        )
                    yield _request(count - 1, reader.value(), seen)
                    if reader.skip() == ",":
                        reader.at += 1
                        continue
                    break
            reader.expect("]", "',' or ']'")
            if reader.skip() != ",":
                break
            reader.at += 1
    reader.expect("}", "',' or '}'")
    if reader.skip():
        raise BatchBodyError(f"The request body is not valid JSON: extra data at character {reader.at}.")
    if not count:
        raise BatchBodyError("requests: must hold at least one request", "requests")


def _request(index: int, value: Any, seen: set[str]) -> BatchRequest:
    where = f"requests.{index}"
    if not isinstance(value, dict):
        raise BatchBodyError(f"{where}: must be an object with custom_id and params", where)
    extra = sorted(set(value) - {"custom_id", "params"})
    if extra:
        raise BatchBodyError(f"{where}.{extra[0]:.64}: Extra inputs are not permitted", f"{where}.{extra[0]:.64}")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
        raise BatchBodyError(
            f"{where}.custom_id: must be 1 to 64 characters of letters, digits, '_' and '-', got {custom_id!r:.80}",
            f"{where}.custom_id",
        )
    if custom_id in seen:
        raise BatchBodyError(
            f"{where}.custom_id: {custom_id!r} is used by another request; custom_id must be unique within the batch",
            f"{where}.custom_id",
        )
    seen.add(custom_id)
    params = value.get("params")
    if not isinstance(params, dict):
        raise BatchBodyError(f"{where}.params: must be an object", f"{where}.params")
    return BatchRequest(index, custom_id, params)
