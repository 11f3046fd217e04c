"""Validate one request body (OpenAI chat/completions style) into prompt + sampling kwargs.

The sampling dict uses the engine's ``SamplingParams`` field names exactly (``max_tokens,
temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos,
repetition_penalty, presence_penalty, frequency_penalty, logprobs, n, min_tokens,
logit_bias``), so the task layer can do ``SamplingParams(**request.sampling)``. ``echo`` is
not sampling: ``echo_from_body`` reads it. Every user-controlled size is bounded by
``InputLimits``. Problems raise ``InvalidRequest`` naming the field and what is wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from conveyor.worker.batchio import response_format as formats
from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.batchio.body_errors import InvalidRequest, shown
from conveyor.worker.batchio.embeddings_body import EMBEDDINGS
from conveyor.worker.batchio.reasoning_parsers import REASONING_EFFORTS
from conveyor.worker.batchio.rerank_body import RERANK
from conveyor.worker.batchio.responses_body import RESPONSES
from conveyor.worker.batchio.score_body import SCORE
from conveyor.worker.core.limits import InputLimits

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, SCORE, RERANK)
# What a batch line's url may name: OpenAI's endpoints and Anthropic's Messages (the Message
# Batches door stores its requests as such lines).
LINE_ENDPOINTS = (*ENDPOINTS, MESSAGES)

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MAX_SEED = 2**63 - 1


def _invalid(param: str, what: str, value: Any) -> InvalidRequest:
    return InvalidRequest("invalid_value", f"{param} must be {what}, got {shown(value)}", param)


def _text(param: str, value: str) -> str:
    """``value`` if a tokenizer can take it: a ``\\ud800`` escape in JSON gives a lone
    surrogate, which has no UTF-8 form."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                "invalid_value",
                f"{param} has a lone surrogate ({value[exc.start]!r}) at character {exc.start}; "
                "text must be valid Unicode",
                param,
            ) from None
    return value


# ---- scalar checks ----------------------------------------------------------------------


def _int(param: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _invalid(param, f"an integer from {low} to {high}", value)
    return value


def _float(param: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    # Comparing, not converting: a huge int never overflows a float, and NaN and the
    # infinities fail the comparisons.
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"greater than {low}" if low_open else f"at least {low}"
        raise _invalid(param, f"a number {bound} and at most {high}", value)
    return float(value)


def _bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _invalid(param, "true or false", value)
    return value


def _stop(param: str, value: Any, limits: InputLimits) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > limits.max_stop_sequences:
        raise _invalid(param, f"a string or a list of at most {limits.max_stop_sequences} strings", value)
    for s in items:
        if not isinstance(s, str) or not s or len(s) > limits.max_stop_chars:
            raise _invalid(param, f"made of non-empty strings of at most {limits.max_stop_chars} characters", s)
        _text(param, s)
    return items


_TOKEN_KEY = re.compile(r"[0-9]{1,10}")


def _logit_bias(value: Any, limits: InputLimits) -> dict[int, float]:
    """OpenAI's ``{"<token id>": bias}``: keys are decimal token ids (JSON keys are strings),
    biases numbers from -100 to 100. Whether an id is in the vocabulary only the engine
    knows: it refuses the request at submission (a 400 on that line)."""
    if not isinstance(value, dict):
        raise _invalid("logit_bias", "an object mapping token ids to biases", value)
    if len(value) > limits.max_logit_bias:
        raise InvalidRequest(
            "invalid_value", f"logit_bias has {len(value)} entries; at most {limits.max_logit_bias}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_KEY.fullmatch(key):
            raise _invalid("logit_bias", 'keyed by token ids (decimal integers such as "50256")', key)
        out[int(key)] = _float(f"logit_bias[{key}]", bias, -100.0, 100.0)
    return out


def _token_ids(param: str, value: Any, max_count: int) -> list[int]:
    if not isinstance(value, list) or len(value) > max_count:
        raise _invalid(param, f"a list of at most {max_count} token ids", value)
    for t in value:
        _int(param, t, 0, 2**31 - 1)
    return value


# Fields shared by both endpoints: name -> checker(value, limits) -> engine value.
_COMMON: dict[str, Callable[[Any, InputLimits], Any]] = {
    "temperature": lambda v, lim: _float("temperature", v, 0.0, 2.0),
    "top_p": lambda v, lim: _float("top_p", v, 0.0, 1.0, low_open=True),
    "n": lambda v, lim: _int("n", v, 1, lim.max_n),
    "seed": lambda v, lim: _int("seed", v, 0, _MAX_SEED),
    "stop": lambda v, lim: _stop("stop", v, lim),
    "presence_penalty": lambda v, lim: _float("presence_penalty", v, -2.0, 2.0),
    "frequency_penalty": lambda v, lim: _float("frequency_penalty", v, -2.0, 2.0),
    "logit_bias": _logit_bias,
    # Extensions beyond OpenAI (as vLLM accepts them).
    "top_k": lambda v, lim: _int("top_k", v, -1, 1_000_000),
    "min_p": lambda v, lim: _float("min_p", v, 0.0, 1.0),
    "repetition_penalty": lambda v, lim: _float("repetition_penalty", v, 0.0, 10.0, low_open=True),
    "stop_token_ids": lambda v, lim: _token_ids("stop_token_ids", v, lim.max_stop_token_ids),
    "ignore_eos": lambda v, lim: _bool("ignore_eos", v),
    "min_tokens": lambda v, lim: _int("min_tokens", v, 0, lim.max_tokens),
    # Reasoning models: at most this many thinking tokens (vLLM's name), then the answer.
    "thinking_token_budget": lambda v, lim: _int("thinking_token_budget", v, 0, lim.max_tokens),
}

# Accepted and ignored when they hold a harmless value (None always counts as absent).
_IGNORED: dict[str, Callable[[Any], bool]] = {
    "model": lambda v: isinstance(v, str),
    "user": lambda v: isinstance(v, str),
    "metadata": lambda v: isinstance(v, dict),
    "store": lambda v: isinstance(v, bool),
    "service_tier": lambda v: isinstance(v, str),
    "safety_identifier": lambda v: isinstance(v, str),
    "prompt_cache_key": lambda v: isinstance(v, str),
    "stream": lambda v: v is False,
    "echo": lambda v: v is False,  # chat (completions take it: see the loop)
    "suffix": lambda v: v == "",
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "tool_choice": lambda v: v == "none",
    "tools": lambda v: v == [],
}

_UNSUPPORTED_HINT = {
    "stream": "batch requests cannot stream",
    "tools": "tools are supported on /v1/chat/completions only",
    "functions": "function calling is not supported",
    "tool_choice": "tools are supported on /v1/chat/completions only",
    "echo": "echo is a completions parameter",
    "suffix": "suffix (text after the completion, for insertion) needs a fill-in-the-middle model",
}


# A chat request's controls of its template, read by ``template_controls``.
_TEMPLATE_FIELDS = ("chat_template_kwargs", "reasoning_effort")

# A chat request's tool fields, read by ``conveyor.worker.batchio.tools`` (for completions they are
# accepted only when they ask for nothing, as in ``_IGNORED``).
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def _max_tokens(body: Mapping[str, Any], limits: InputLimits) -> int:
    a, b = body.get("max_tokens"), body.get("max_completion_tokens")
    if a is not None and b is not None:
        raise InvalidRequest(
            "invalid_request", "give max_tokens or max_completion_tokens, not both", "max_completion_tokens"
        )
    if b is not None:
        return _int("max_completion_tokens", b, 1, limits.max_tokens)
    if a is not None:
        return _int("max_tokens", a, 1, limits.max_tokens)
    return limits.default_max_tokens


def sampling_from_body(body: Mapping[str, Any], endpoint: str, limits: InputLimits, *, strict: bool) -> dict[str, Any]:
    """SamplingParams kwargs from ``body``. ``strict``: unknown fields are errors (OpenAI
    batch lines); otherwise unknown fields are ignored (rows of a plain dataset)."""
    sampling: dict[str, Any] = {"max_tokens": _max_tokens(body, limits)}
    chat = endpoint == CHAT
    for name, value in body.items():
        if value is None or _read_elsewhere(name, chat):
            continue
        if name in _COMMON:
            sampling[name] = _COMMON[name](value, limits)
        elif name == "logprobs" or (name == "top_logprobs" and chat):
            _read_logprobs(sampling, name, value, chat, limits)
        elif name in ("response_format", "structured_outputs"):
            _read_constraint(sampling, name, value, limits)
        else:
            _check_unsampled(name, value, body, endpoint, strict)
    _check_together(body, sampling, chat)
    if echo_from_body(body, endpoint) and "logprobs" in sampling:
        # The echoed prompt's tokens come with their logprobs too, as OpenAI's completions give
        # them (scoring a text: the model's logprob of each of its tokens).
        sampling["prompt_logprobs"] = sampling["logprobs"]
    return sampling


def _read_elsewhere(name: str, chat: bool) -> bool:
    """A field another reader takes: the prompt and the token limit, and a chat request's tool
    fields (``conveyor.worker.batchio.tools``) and template controls (``template_controls``)."""
    if name in ("max_tokens", "max_completion_tokens", "messages", "prompt"):
        return True
    return chat and (name in _TOOL_FIELDS or name in _TEMPLATE_FIELDS)


def _read_logprobs(sampling: dict[str, Any], name: str, value: Any, chat: bool, limits: InputLimits) -> None:
    """Chat's ``logprobs`` (a flag) and ``top_logprobs`` (how many alternatives), or
    completions' ``logprobs`` (how many alternatives)."""
    if name == "logprobs" and chat:
        if _bool("logprobs", value):
            sampling.setdefault("logprobs", 0)
    else:
        sampling["logprobs"] = _int(name, value, 0, limits.max_logprobs)


def _read_constraint(sampling: dict[str, Any], name: str, value: Any, limits: InputLimits) -> None:
    """``response_format`` or ``structured_outputs``: at most one of them constrains the output."""
    read = formats.response_format if name == "response_format" else formats.structured_outputs
    constraint = read(value, limits)
    if constraint is None:
        return
    if "structured_outputs" in sampling:
        raise InvalidRequest("invalid_request", "give response_format or structured_outputs, not both", name)
    sampling["structured_outputs"] = constraint


def _check_unsampled(name: str, value: Any, body: Mapping[str, Any], endpoint: str, strict: bool) -> None:
    """A field that is no sampling parameter: accepted when it asks for nothing the engine
    cannot do (``strict``: an unknown one is an error)."""
    chat = endpoint == CHAT
    if name == "echo" and not chat:
        _bool("echo", value)  # not sampling: echo_from_body
    elif name == "best_of" and not chat:
        if value != body.get("n", 1):
            raise InvalidRequest("unsupported", "best_of is not supported (unless equal to n)", "best_of")
    elif name in _IGNORED:
        if strict and not _IGNORED[name](value):
            hint = _UNSUPPORTED_HINT.get(name, f"unsupported value for {name}")
            raise InvalidRequest("unsupported", f"{hint} ({name}={shown(value)})", name)
    elif strict:
        raise InvalidRequest("unknown_parameter", f"unknown parameter {name!r} for {endpoint}", name)


def _check_together(body: Mapping[str, Any], sampling: dict[str, Any], chat: bool) -> None:
    """The rules between fields: chat's ``top_logprobs`` needs ``logprobs``; ``min_tokens`` at
    most ``max_tokens``."""
    if chat and "top_logprobs" in body and body["top_logprobs"] is not None and body.get("logprobs") is not True:
        raise InvalidRequest("invalid_request", "top_logprobs needs logprobs: true", "top_logprobs")
    if sampling.get("min_tokens", 0) > sampling["max_tokens"]:
        raise InvalidRequest(
            "invalid_value",
            f"min_tokens ({sampling['min_tokens']}) must not exceed max_tokens ({sampling['max_tokens']})",
            "min_tokens",
        )


def template_controls(body: Mapping[str, Any], limits: InputLimits) -> tuple[dict[str, Any] | None, str | None]:
    """A chat body's ``chat_template_kwargs`` (checked: an object of at most
    ``max_chat_template_kwargs`` plain JSON entries) and ``reasoning_effort``. Whether the
    model's family defines an effort is the worker's to say (its reasoning parser)."""
    kwargs, effort = body.get("chat_template_kwargs"), body.get("reasoning_effort")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or len(kwargs) > limits.max_chat_template_kwargs:
            raise _invalid(
                "chat_template_kwargs", f"an object of at most {limits.max_chat_template_kwargs} entries", kwargs
            )
        for key in kwargs:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key):
                raise _invalid("chat_template_kwargs", "keyed by template variable names", key)
        if len(json.dumps(kwargs)) > limits.max_schema_bytes:
            raise _invalid("chat_template_kwargs", f"at most {limits.max_schema_bytes} bytes as JSON", "...")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise _invalid("reasoning_effort", "one of " + ", ".join(f'"{e}"' for e in REASONING_EFFORTS), effort)
    return kwargs or None, effort


def echo_from_body(body: Mapping[str, Any], endpoint: str) -> bool:
    """Whether a completions body asks for the prompt in front of the text (checked by
    ``sampling_from_body``)."""
    return endpoint == COMPLETIONS and body.get("echo") is True


# ---- prompts ------------------------------------------------------------------------------


def parse_messages(value: Any, limits: InputLimits) -> list[dict[str, Any]]:
    """Chat messages normalised to ``[{"role", "content": str}]`` (text parts joined). A tool
    conversation keeps what the template renders: an assistant's past ``tool_calls`` (their
    arguments as JSON objects, as chat templates expect them), its past thinking and a ``tool``
    message's ``tool_call_id``."""
    if not isinstance(value, list) or not value:
        raise _invalid("messages", "a non-empty list of messages", value)
    if len(value) > limits.max_messages:
        raise InvalidRequest(
            "invalid_value", f"messages has {len(value)} entries; at most {limits.max_messages}", "messages"
        )
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _invalid(where, "an object with role and content", msg)
        role = msg.get("role")
        if role not in _ROLES and role != "tool":
            raise _invalid(f"{where}.role", "one of system, developer, user, assistant, tool", role)
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id or len(call_id) > 256:
                raise _invalid(f"{where}.tool_call_id", "the id of the call this message answers", call_id)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _content(f"{where}.content", msg.get("content"), role),
                }
            )
            continue
        entry: dict[str, Any] = {
            "role": _ROLES[role],
            "content": _content(f"{where}.content", msg.get("content"), role),
        }
        reasoning = _past_reasoning(where, msg, role)
        if reasoning is not None:
            # Under both names the published templates read it: ``reasoning_content`` (Qwen3,
            # Qwen3.5, GLM-4.5, Gemma 4, SmolLM3) and ``thinking`` (gpt-oss).
            entry["reasoning_content"] = entry["thinking"] = reasoning
        if msg.get("tool_calls"):
            if role != "assistant":
                raise InvalidRequest(
                    "invalid_value", f"{where}: only assistant messages carry tool_calls", f"{where}.tool_calls"
                )
            entry["tool_calls"] = _past_tool_calls(f"{where}.tool_calls", msg["tool_calls"], limits)
        out.append(entry)
    return out


def _past_reasoning(where: str, msg: dict[str, Any], role: str) -> str | None:
    """An assistant's past thinking, sent as ``reasoning_content`` (DeepSeek's and vLLM's
    name) or ``reasoning`` (vLLM's newer one, and this worker's output field)."""
    for name in ("reasoning_content", "reasoning"):
        value = msg.get(name)
        if value is None:
            continue
        if role != "assistant":
            raise InvalidRequest("invalid_value", f"{where}: only assistant messages carry {name}", f"{where}.{name}")
        if not isinstance(value, str):
            raise _invalid(f"{where}.{name}", "a string", value)
        return _text(f"{where}.{name}", value)
    return None


def _past_tool_calls(param: str, calls: Any, limits: InputLimits) -> list[dict[str, Any]]:
    """An assistant's past calls, ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]`` with ``arguments`` parsed (OpenAI sends them as JSON text)."""
    if not isinstance(calls, list) or len(calls) > limits.max_tools:
        raise _invalid(param, f"a list of at most {limits.max_tools} tool calls", calls)
    out = []
    for k, call in enumerate(calls):
        where = f"{param}[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or call.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
        ):
            raise _invalid(where, '{"id", "type": "function", "function": {"name", "arguments"}}', call)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise _invalid(f"{where}.function.arguments", "a JSON object (as text)", args) from None
        if not isinstance(args, dict):
            raise _invalid(f"{where}.function.arguments", "a JSON object", args)
        call_id = call.get("id")
        entry: dict[str, Any] = {"type": "function", "function": {"name": _text(where, fn["name"]), "arguments": args}}
        if isinstance(call_id, str):
            entry["id"] = call_id
        out.append(entry)
    return out


def _content(param: str, content: Any, role: str) -> str:
    if isinstance(content, str):
        return _text(param, content)
    if content is None and role in ("assistant", "tool"):
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    "unsupported", f"{param}[{j}]: only text parts are supported, got type {kind!r}", f"{param}[{j}]"
                )
            texts.append(_text(f"{param}[{j}].text", part["text"]))
        return "\n".join(texts)
    raise _invalid(param, "a string or a list of text parts", content)


def parse_prompt(value: Any) -> str | list[int]:
    """A completion prompt: a non-empty string, one-string list, or a list of token ids."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("invalid_value", "prompt is empty", "prompt")
        return _text("prompt", value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) < 0:
            raise _invalid("prompt", "token ids >= 0", value)
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
        raise InvalidRequest(
            "unsupported", "several prompts in one request are not supported; use one line each", "prompt"
        )
    raise _invalid("prompt", "a non-empty string or a list of token ids", value)
