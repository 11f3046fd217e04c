"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.inputs.text_checks import check_text
from conveyor.engine.pooling.pooling_params import PoolingParams
from conveyor.engine.structured.structured_outputs import StructuredOutputs

# Limits on user-supplied sizes and counts.
MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (the worker allows OpenAI's 300 by default)
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_CACHE_SALT_CHARS = 256
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy.

    ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` means "until the model's
    context is full". ``logprobs=k`` returns the chosen token's logprob plus the ``k`` most
    likely alternatives at each step (``0``: the chosen token only); ``prompt_logprobs=k`` the
    same for each prompt token after the first, from the model's distribution at the position
    before it (what scoring a text needs: ``RequestOutput.prompt_logprobs``; such a request
    computes its whole prompt, never reading it from the prefix cache). A sample ``i`` of a
    seeded request with ``n > 1`` uses seed ``seed + i``. ``stream=False`` asks only for the
    final output (``LLMEngine.step`` then reports the request once, when it finishes), which
    spares the per-step bookkeeping: ``LLM.generate`` uses it.

    ``min_tokens``: until this many tokens are generated, EOS and ``stop_token_ids`` are
    masked out and stop strings are not looked for (vLLM's semantics: a stop string must end
    in the text of a later token). ``logit_bias`` maps token ids to a value in [-100, 100]
    added to that token's logit before penalties, temperature and the top-k/top-p/min-p
    filters (OpenAI's semantics); ids outside the model's vocabulary are refused by
    ``LLMEngine.add_request``.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    stream: bool = True
    # Constrained decoding (JSON Schema, regex, choice, grammar); a dict of its fields is taken too.
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None
    # Prefix-cache isolation (vLLM's ``cache_salt``): mixed into the root of the request's block
    # hash chain, so it reuses cached blocks only of requests with the same salt (None: unsalted).
    cache_salt: str | None = None
    # Reasoning models: the texts that open and close the thinking block (None: no thinking
    # handling, unless a budget is set: then ("<think>", "</think>")). The structured-output
    # grammar then constrains only what follows the block (``conveyor.engine.structured.thinking``).
    thinking_delimiters: tuple[str, str] | list[str] | None = None
    # At most this many thinking tokens, then the closing delimiter is forced (vLLM's name).
    thinking_token_budget: int | None = None
    # An embedding request: the prompt is pooled into one vector (``RequestOutput.embedding``)
    # instead of generating; the sampling fields are then ignored (``conveyor.engine.pooling.pooler``). A dict
    # of its fields is taken too.
    pooling: PoolingParams | dict[str, Any] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_stops()
        self.structured_outputs = StructuredOutputs.coerce(self.structured_outputs)
        self._check_thinking()
        self._check_pooling_and_salt()

    def _check_sampling(self) -> None:
        """The numbers that shape sampling, each within its range, and the flags booleans."""
        _check_int("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_float("temperature", self.temperature, 0.0, None)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        for name in ("ignore_eos", "skip_special_tokens", "stream"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _check_stops(self) -> None:
        self.stop_strings = _normalise_stop(self.stop)
        ids = self.stop_token_ids or ()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(ids)} entries; at most {MAX_STOP_TOKEN_IDS}")
        for t in ids:
            _check_int("stop_token_ids", t, 0, None)
        self.stop_token_ids = tuple(ids)

    def _check_thinking(self) -> None:
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, 0, None)
        if self.thinking_delimiters is not None:
            pair = self.thinking_delimiters
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"thinking_delimiters must be two strings (open, close), got {pair!r}")
            for text in pair:
                if not isinstance(text, str) or not text or len(text) > MAX_STOP_STRING_CHARS:
                    raise ValueError(f"thinking_delimiters must be non-empty strings, got {text!r}")
                check_text(text, "thinking_delimiters")
            self.thinking_delimiters = (pair[0], pair[1])

    def _check_pooling_and_salt(self) -> None:
        if isinstance(self.pooling, dict):
            try:
                self.pooling = PoolingParams(**self.pooling)
            except TypeError as exc:
                raise ValueError(f"pooling: {exc}") from None
        if self.pooling is not None and not isinstance(self.pooling, PoolingParams):
            raise ValueError(f"pooling must be PoolingParams or None, got {type(self.pooling).__name__}")
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str) or not self.cache_salt:
                raise ValueError(f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}")
            if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
                raise ValueError(f"cache_salt has {len(self.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
            check_text(self.cache_salt, "cache_salt")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0


def _check_int(name: str, value: object, low: int | None, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_float(name: str, value: object, low: float | None, high: float | None, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for token, value in bias.items():
        _check_int("logit_bias token id", token, 0, None)
        _check_float(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)
        out[token] = float(value)
    return out or None


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string is {len(s)} characters; at most {MAX_STOP_STRING_CHARS}")
        check_text(s, "stop")
    return tuple(items)
