"""One input record (a JSONL line, a CSV row, a Parquet row) as a ``ParsedRequest`` or a
``LineError``, and the errors that reject a whole input (``InputError``).

A record is an OpenAI Batch line (``{"custom_id", "method": "POST", "url", "body"}``; unknown
fields are errors, as with OpenAI) or a plain dataset row (``{"prompt": ...}`` or
``{"messages": [...]}`` plus optional ``custom_id``/``id`` and sampling fields at the top
level; other fields are ignored). Rows without an id get ``custom_id = "line-<n>"``. A batch
created through the HTTP API (``RequestOptions.endpoint``) takes only OpenAI Batch lines to
its endpoint: any other line is a ``url_mismatch`` error.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.batchio.anthropic_body import chat_body as messages_chat_body
from conveyor.worker.batchio.embeddings_body import EMBEDDINGS, EmbeddingInput, parse_embeddings_body
from conveyor.worker.batchio.request_body import (
    CHAT,
    COMPLETIONS,
    LINE_ENDPOINTS,
    InvalidRequest,
    echo_from_body,
    parse_messages,
    parse_prompt,
    sampling_from_body,
    shown,
    template_controls,
)
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.batchio.rerank_body import RERANK, RerankOptions, parse_rerank_body
from conveyor.worker.batchio.responses_body import RESPONSES, chat_body
from conveyor.worker.batchio.score_body import SCORE, SCORE_SAMPLING, parse_score_body
from conveyor.worker.batchio.tools import ToolRequest, apply_tools
from conveyor.worker.core.limits import MAX_CUSTOM_ID_CHARS, InputLimits

log = logging.getLogger(__name__)

_OPENAI_KEYS = {"custom_id", "method", "url", "body"}
# The Responses fields a ``response`` object repeats.
_ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "temperature", "top_p",
           "tool_choice", "tools", "text", "reasoning")  # fmt: skip


class InputFormat(str, enum.Enum):
    jsonl = "jsonl"  # OpenAI Batch lines and plain prompt lines, told apart per line
    csv = "csv"
    parquet = "parquet"  # a prompt (or messages) column; rows numbered from 1 like lines


class InputError(ValueError):
    """The input as a whole cannot be accepted (the job fails at validation). ``code``,
    ``line`` and ``param`` become the job's error, shaped as OpenAI's ``BatchError``."""

    def __init__(
        self, message: str, *, code: str = "invalid_input", line: int | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.line, self.param = code, line, param
        self.endpoint: str | None = None  # set by intake: the endpoint of the requests before it


class InputTooLarge(InputError):
    """The input exceeds a size or count limit."""


@dataclass(frozen=True)
class ParsedRequest:
    """One valid input line. Exactly one of ``prompt`` / ``messages`` / ``inputs`` (an
    embeddings request's) / ``pairs`` (a score or rerank request's) is set."""

    line: int  # 1-based line number in the input file (CSV: the record's first line)
    custom_id: str
    # CHAT, COMPLETIONS, EMBEDDINGS, or RESPONSES or MESSAGES (read as the chat request they amount to)
    endpoint: str
    sampling: dict[str, Any]  # SamplingParams(**sampling)
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    echo: bool = False  # completions: the prompt goes in front of the text
    tools: ToolRequest | None = None  # a chat request's tools and tool_choice
    # A ``prompt`` row's chat: rendered through the chat template as one user message (True),
    # sent as it is (False), or rendered when the model has a template (None: auto).
    chat: bool | None = False
    system_prompt: str | None = None  # the system message in front of a prompt rendered as chat
    # Chat and responses: variables for the chat template, and the reasoning effort asked for
    # (the worker's reasoning parser maps it onto the template or refuses it).
    template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # Responses: the request's fields a ``response`` object repeats (instructions, tools...);
    # Messages: its ``stop_sequences``, which the ``Message`` tells apart from other stops.
    echoed: dict[str, Any] | None = None
    inputs: list[EmbeddingInput] | None = None  # an embeddings request's inputs, one vector each
    encoding_format: str | None = None  # ... and how its vectors are written (float, base64)
    pairs: list[list[str]] | None = None  # a score or rerank request's [text_1, text_2] pairs, one score each
    rerank: RerankOptions | None = None  # ... a rerank request's top_n and return_documents

    def to_json(self) -> dict[str, Any]:
        """A compact dict for a shard's input file (``from_json`` reads it back)."""
        data: dict[str, Any] = {"line": self.line, "custom_id": self.custom_id, "endpoint": self.endpoint}
        if self.messages is not None:
            data["messages"] = self.messages
        elif self.inputs is not None:
            data["inputs"], data["encoding_format"] = self.inputs, self.encoding_format
        elif self.pairs is not None:
            data["pairs"] = self.pairs
            if self.rerank is not None:
                data["rerank"] = self.rerank.to_json()
        else:
            data["prompt"] = self.prompt
        data["sampling"] = self.sampling
        if self.echo:  # only when set: shard files written before it read back the same
            data["echo"] = True
        if self.tools is not None:
            data["tools"] = self.tools.to_json()
        if self.chat is not False:  # only when set, as echo
            data["chat"] = self.chat
        if self.system_prompt is not None:
            data["system_prompt"] = self.system_prompt
        for name in ("template_kwargs", "reasoning_effort", "echoed"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ParsedRequest:
        sampling = dict(data["sampling"])
        if isinstance(sampling.get("logit_bias"), dict):  # JSON turned its int keys into strings
            sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
        return cls(
            line=data["line"],
            custom_id=data["custom_id"],
            endpoint=data["endpoint"],
            sampling=sampling,
            prompt=data.get("prompt"),
            messages=data.get("messages"),
            echo=data.get("echo", False) is True,
            tools=ToolRequest.from_json(data["tools"]) if data.get("tools") else None,
            chat=data.get("chat", False),
            system_prompt=data.get("system_prompt"),
            template_kwargs=data.get("template_kwargs"),
            reasoning_effort=data.get("reasoning_effort"),
            echoed=data.get("echoed"),
            inputs=data.get("inputs"),
            encoding_format=data.get("encoding_format"),
            pairs=data.get("pairs"),
            rerank=RerankOptions.from_json(data["rerank"]) if data.get("rerank") else None,
        )


@dataclass(frozen=True)
class LineError:
    """An input line rejected at validation."""

    line: int
    code: str  # invalid_json, invalid_request, invalid_value, unknown_parameter, unsupported,
    #            missing_prompt, duplicate_custom_id, line_too_long, invalid_encoding, invalid_csv,
    #            invalid_row (a Parquet row pyarrow cannot convert), url_mismatch
    message: str
    custom_id: str | None = None
    param: str | None = None


def _custom_id(value: Any, limits: InputLimits, *, required: bool, line: int) -> str:
    if value is None and not required:
        return f"line-{line}"
    if isinstance(value, int) and not isinstance(value, bool) and not required:
        value = str(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequest("invalid_request", "custom_id must be a non-empty string", "custom_id")
    if len(value) > limits.max_custom_id_chars:
        raise InvalidRequest(
            "invalid_value", f"custom_id is longer than {limits.max_custom_id_chars} characters", "custom_id"
        )
    if "\x00" in value or not _encodable(value):
        raise InvalidRequest(
            "invalid_value", "custom_id must be UTF-8 text without NUL characters or lone surrogates", "custom_id"
        )
    return value


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def request_from_object(
    obj: Any, line: int, limits: InputLimits, options: RequestOptions | None = None
) -> ParsedRequest:
    """One JSON object (OpenAI Batch line or plain row) -> ParsedRequest, or InvalidRequest.
    ``options``: the job's (sampling defaults under the line's fields, the system prompt, chat
    for ``prompt`` rows)."""
    options = options or RequestOptions()
    if not isinstance(obj, dict):
        raise InvalidRequest("invalid_request", f"a line must be a JSON object, got {type(obj).__name__}")
    if options.endpoint is not None:
        _check_batch_endpoint(obj, options.endpoint)
    if _batch_line_without_body(obj):
        raise InvalidRequest("missing_prompt", "a request needs a body with a prompt or messages", "body")
    if "body" in obj:  # OpenAI Batch line
        custom_id, endpoint = _batch_line_envelope(obj, line, limits)
        body, strict, plain = options.body_with_defaults(obj["body"]), True, False
    else:  # a plain dataset row
        custom_id = _custom_id(obj.get("custom_id", obj.get("id")), limits, required=False, line=line)
        body, strict, plain = options.body_with_defaults(obj), False, True
        endpoint = CHAT if "messages" in obj else EMBEDDINGS if "input" in obj and "prompt" not in obj else COMPLETIONS
    if endpoint in (EMBEDDINGS, SCORE, RERANK):
        return _unsampled_request(obj, line, custom_id, endpoint, limits, plain=plain)
    if endpoint in (CHAT, RESPONSES, MESSAGES):
        return _chat_request(obj, body, line, custom_id, endpoint, limits, options, strict=strict)
    if "prompt" not in body:
        what = "a completions request needs a prompt" if strict else "no prompt or messages field"
        raise InvalidRequest("missing_prompt", what, "prompt")
    prompt = parse_prompt(body["prompt"])
    sampling = sampling_from_body(body, endpoint, limits, strict=strict)
    chat = options.chat if plain and isinstance(prompt, str) else False  # token ids are never rendered
    return ParsedRequest(
        line, custom_id, endpoint, sampling, prompt=prompt, echo=echo_from_body(body, endpoint), chat=chat,
        system_prompt=options.system_prompt if chat is not False else None,
    )  # fmt: skip


def _batch_line_envelope(obj: dict[str, Any], line: int, limits: InputLimits) -> tuple[str, str]:
    """An OpenAI Batch line's ``custom_id`` and endpoint (its ``url``), its envelope checked:
    no unknown field, ``POST``, a served endpoint, a ``body`` object."""
    custom_id = _custom_id(obj.get("custom_id"), limits, required=True, line=line)
    extra = sorted(set(obj) - _OPENAI_KEYS)
    if extra:
        raise InvalidRequest("unknown_parameter", f"unknown field(s) {', '.join(extra)} in a batch line", extra[0])
    if obj.get("method") != "POST":
        raise InvalidRequest("invalid_value", f'method must be "POST", got {shown(obj.get("method"))}', "method")
    endpoint = obj.get("url")
    if endpoint not in LINE_ENDPOINTS:
        raise InvalidRequest(
            "invalid_value", f"url must be one of {', '.join(LINE_ENDPOINTS)}, got {shown(endpoint)}", "url"
        )
    if not isinstance(obj["body"], dict):
        raise InvalidRequest("invalid_request", "body must be a JSON object", "body")
    return custom_id, endpoint


def _unsampled_request(
    obj: dict[str, Any], line: int, custom_id: str, endpoint: str, limits: InputLimits, *, plain: bool
) -> ParsedRequest:
    """An embeddings, score or rerank request: no generation, so none of the job's sampling defaults."""
    if endpoint == EMBEDDINGS:
        # The job's sampling defaults are for generation: an embeddings body is read as sent.
        inputs, sampling, encoding = parse_embeddings_body(obj if plain else obj["body"], limits, strict=not plain)
        return ParsedRequest(line, custom_id, endpoint, sampling, inputs=inputs, encoding_format=encoding)
    if endpoint == SCORE:
        pairs = parse_score_body(obj["body"], limits)
        return ParsedRequest(line, custom_id, endpoint, dict(SCORE_SAMPLING), pairs=pairs)
    pairs, rerank = parse_rerank_body(obj["body"], limits)
    return ParsedRequest(line, custom_id, endpoint, dict(SCORE_SAMPLING), pairs=pairs, rerank=rerank)


def _chat_request(
    obj: dict[str, Any], body: dict[str, Any], line: int, custom_id: str, endpoint: str,
    limits: InputLimits, options: RequestOptions, *, strict: bool,
) -> ParsedRequest:  # fmt: skip
    """A chat request: chat completions, or a Responses or Anthropic Messages body read as one."""
    echoed = None
    if endpoint == RESPONSES:
        echoed = {k: body[k] for k in _ECHOED if body.get(k) is not None}
        body = chat_body(body)
    elif endpoint == MESSAGES:  # read as sent: the job's defaults use chat's names
        body = options.body_with_defaults(messages_chat_body(obj["body"]))
        echoed = {"stop_sequences": body["stop"]} if body.get("stop") else None
    if "messages" not in body:
        raise InvalidRequest("missing_prompt", "a chat request needs messages", "messages")
    messages = options.with_system(parse_messages(body["messages"], limits))
    sampling = sampling_from_body(body, CHAT, limits, strict=strict)
    tools = apply_tools(body, sampling, limits)
    kwargs, effort = template_controls(body, limits)
    return ParsedRequest(
        line, custom_id, endpoint, sampling, messages=messages, tools=tools, template_kwargs=kwargs,
        reasoning_effort=effort, echoed=echoed,
    )  # fmt: skip


def record_from_object(
    obj: Any, line: int, limits: InputLimits, options: RequestOptions | None = None
) -> ParsedRequest | LineError:
    """``request_from_object``, with a rejected line as its ``LineError``: whatever its
    validation raises, one line fails alone."""
    try:
        return request_from_object(obj, line, limits, options)
    except InvalidRequest as exc:
        return LineError(line, exc.code, exc.message, guess_custom_id(obj), exc.param)
    except Exception as exc:  # a validator's bug or a bomb it did not foresee: this line's error
        log.warning("line %d could not be validated: %s", line, type(exc).__name__)
        return LineError(line, "invalid_request", unvalidated_reason(exc), guess_custom_id(obj))


def unvalidated_reason(exc: Exception) -> str:
    """What to tell the user about a line whose validation raised ``exc`` (the type only:
    the exception's own text may quote internals)."""
    if isinstance(exc, RecursionError):
        return "the line is nested too deeply to be validated; flatten its JSON values"
    if isinstance(exc, MemoryError):
        return "the line is too large to be validated"
    if isinstance(exc, UnicodeError):
        return "the line holds text that is not valid Unicode"
    return f"the line could not be validated ({type(exc).__name__}); please report this"


def _check_batch_endpoint(obj: dict[str, Any], endpoint: str) -> None:
    """An API batch's line must be an OpenAI Batch request to the batch's ``endpoint``: a plain
    row would run as whatever it looks like (a text completion, embeddings), which the batch's
    endpoint and its charge never allowed."""
    url = obj.get("url")
    if url != endpoint:
        what = "a line without a url (a plain dataset row?)" if url is None else f"url {shown(url)}"
        raise InvalidRequest(
            "url_mismatch",
            f"{what} in a batch created for endpoint {endpoint}: every line must be an OpenAI Batch request "
            f'{{"custom_id", "method": "POST", "url": "{endpoint}", "body"}}',
            "url",
        )
    if "body" not in obj:
        raise InvalidRequest("missing_prompt", f"a request to {endpoint} needs a body", "body")


def _batch_line_without_body(obj: dict[str, Any]) -> bool:
    """An OpenAI Batch line that lost its body: a ``method`` or an API ``url`` and nothing to
    run (a plain row with a prompt and a ``url`` column of its own is fine)."""
    if "body" in obj or "prompt" in obj or "messages" in obj:
        return False
    url = obj.get("url")
    return "method" in obj or (isinstance(url, str) and url.startswith("/v1/"))


class OneEndpoint:
    """OpenAI Batch lines of one input must all ask for one ``url`` (OpenAI requires one
    endpoint per batch): the first such line fixes it, and a later line asking for another is
    that line's ``url_mismatch`` error (one stray line never sinks the job). Lines whose url
    we do not serve are line errors and fix nothing; plain rows are not checked (each runs
    as its own endpoint)."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.line = 0

    def check(self, obj: Any, line: int) -> LineError | None:
        if not isinstance(obj, dict) or "body" not in obj or obj.get("url") not in LINE_ENDPOINTS:
            return None
        url = obj["url"]
        if self.url is None:
            self.url, self.line = url, line
            return None
        if url == self.url:
            return None
        return LineError(
            line,
            "url_mismatch",
            f"url {url} differs from this batch's endpoint {self.url} (set by line {self.line}): OpenAI "
            "requires one endpoint per batch; submit these lines as a job of their own",
            guess_custom_id(obj),
            "url",
        )


def guess_custom_id(obj: Any) -> str | None:
    """The custom_id to show with a rejected line, if it is text that can be written."""
    if isinstance(obj, dict):
        cid = obj.get("custom_id", obj.get("id"))
        if isinstance(cid, (str, int)) and not isinstance(cid, bool):
            text = str(cid)[:MAX_CUSTOM_ID_CHARS]
            return text if _encodable(text) else None
    return None
