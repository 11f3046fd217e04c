"""What an uploaded batch file holds, learnt while it streams in, in bounded memory.

``BatchScanner`` is fed the upload's bytes as they arrive (any chunking) and keeps one
partial line at most (a line over ``max_line_bytes`` is counted and skipped, never held); it
reads lines exactly as intake does, through the same reader. It
records what ``POST /v1/batches`` needs to answer at once, without reading the file again:
how many requests it holds, the distinct ``body.model`` values and ``url`` values (a few of
each: a file with more mixes them anyway), and how many lines are not a JSON object.

It judges no line: a malformed line becomes that line's error in the batch's errors file at
intake (``conveyor.worker.batchio.readers``), as any other bad line does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from conveyor.worker.batchio.json_values import loads
from conveyor.worker.batchio.line_reader import LineSplitter, jsonl_lines

MAX_MODELS = 8  # distinct body.model values kept
MAX_URLS = 8  # distinct url values kept
MAX_VALUE_CHARS = 256  # each kept value, at most (the models column's width)
# The largest ``n`` and ``max_tokens`` a line is charged (a bigger one is refused at intake);
# they only keep the sums of a hostile file bounded.
MAX_N = 64
MAX_COUNTED_TOKENS = 1 << 31


@dataclass
class BatchScan:
    lines: int = 0  # non-blank lines: the requests the batch will count
    models: list[str] = field(default_factory=list)  # distinct body.model strings, first seen first
    urls: list[str] = field(default_factory=list)  # distinct url strings, first seen first
    more_models: bool = False  # more distinct models than MAX_MODELS
    more_urls: bool = False
    without_model: int = 0  # JSON objects with no body.model string
    not_json: int = 0  # lines that are not a JSON object (not UTF-8, invalid JSON, an array, ...)
    first_not_json_line: int | None = None
    too_long: int = 0  # lines over the line limit (skipped here; a line error at intake)
    # The output the lines ask for, ``n x max_tokens`` summed over the lines that name a
    # ``max_tokens`` (or ``max_completion_tokens``); the lines that name none are counted in
    # ``default_token_samples`` (their ``n`` summed), to be charged the deployment's default,
    # and so is every line without a body (not JSON, too long, a plain row), once.
    requested_tokens: int = 0
    default_token_samples: int = 0
    # The embedding inputs of the lines' ``body.input``: a string or a token array is one, a
    # list of them is one per entry (what OpenAI's 50,000 per embeddings batch counts).
    embedding_inputs: int = 0

    def as_meta(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "models": self.models,
            "more_models": self.more_models,
            "urls": self.urls,
            "more_urls": self.more_urls,
            "without_model": self.without_model,
            "not_json": self.not_json,
            "first_not_json_line": self.first_not_json_line,
            "too_long": self.too_long,
            "requested_tokens": self.requested_tokens,
            "default_token_samples": self.default_token_samples,
            "embedding_inputs": self.embedding_inputs,
        }

    def output_tokens(self, default_max_tokens: int) -> int:
        """The tokens the batch may generate: ``n x max_tokens`` per line, a line without
        ``max_tokens`` charged ``default_max_tokens`` per sample. (A file scanned before the
        counts were kept is charged the default for each line.)"""
        samples = self.default_token_samples
        if not self.requested_tokens and not samples:
            samples = self.lines
        return self.requested_tokens + samples * default_max_tokens

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> BatchScan:
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in meta.items() if k in known})


class BatchScanner:
    """Feed bytes with ``feed``; ``finish`` gives the ``BatchScan``. Lines are split and
    judged blank, too long or BOM'd by the reader intake uses
    (``conveyor.worker.batchio.line_reader``), so the scan counts the lines intake runs."""

    def __init__(self, max_line_bytes: int) -> None:
        self.scan = BatchScan()
        self._splitter = LineSplitter(max_line_bytes)

    def feed(self, data: bytes) -> None:
        for line_no, raw in jsonl_lines(self._splitter.feed(data)):
            self._line(line_no, raw)

    def finish(self) -> BatchScan:
        for line_no, raw in jsonl_lines(self._splitter.finish()):
            self._line(line_no, raw)
        return self.scan

    def _line(self, line_no: int, raw: bytes | None) -> None:
        scan = self.scan
        scan.lines += 1
        obj = None if raw is None else _parse(raw.strip())
        body = obj.get("body") if isinstance(obj, dict) else None
        if isinstance(body, dict):
            self._count_tokens(body)
            scan.embedding_inputs += _embedding_inputs(body.get("input"))
        else:  # charged too, whatever intake makes of it: no line runs uncharged
            scan.default_token_samples += 1
        if raw is None:
            scan.too_long += 1
            return
        if not isinstance(obj, dict):
            scan.not_json += 1
            if scan.first_not_json_line is None:
                scan.first_not_json_line = line_no
            return
        url = obj.get("url")
        if isinstance(url, str):
            scan.more_urls = _add(scan.urls, url, MAX_URLS) or scan.more_urls
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model:
            scan.more_models = _add(scan.models, model, MAX_MODELS) or scan.more_models
        else:
            scan.without_model += 1

    def _count_tokens(self, body: dict[str, Any]) -> None:
        n = _count(body.get("n"), MAX_N) or 1
        limit = (
            _count(body.get("max_tokens"), MAX_COUNTED_TOKENS)
            or _count(body.get("max_completion_tokens"), MAX_COUNTED_TOKENS)
            or _count(body.get("max_output_tokens"), MAX_COUNTED_TOKENS)  # a /v1/responses line
        )
        if limit:
            self.scan.requested_tokens += n * limit
        else:
            self.scan.default_token_samples += n


def _parse(text: bytes) -> Any:
    """The line's JSON value, or None. The plain parser first (this runs on every byte of an
    upload, and bounding integers costs time); an integer too long for it is retried bounded."""
    try:
        decoded = text.decode("utf-8")
        try:
            return json.loads(decoded)
        except json.JSONDecodeError:
            return None
        except ValueError:  # an integer of more than 4,300 digits
            return loads(decoded)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None


def _embedding_inputs(value: Any) -> int:
    """How many embedding inputs a body's ``input`` holds (0 for none; a malformed one is
    that line's error at intake)."""
    if isinstance(value, str):
        return 1
    if not isinstance(value, list) or not value:
        return 0
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return 1  # one input as token ids
    return len(value)


def _count(value: Any, ceiling: int) -> int:
    """A positive count from a line, at most ``ceiling``; 0 for anything else (that line's
    error comes at intake, where it is charged nothing)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return 0
    return min(value, ceiling)


def _add(values: list[str], value: str, cap: int) -> bool:
    """Add ``value`` (cut to MAX_VALUE_CHARS) unless present; True if it did not fit."""
    value = value[:MAX_VALUE_CHARS]
    if value in values:
        return False
    if len(values) >= cap:
        return True
    values.append(value)
    return False
