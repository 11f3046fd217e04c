"""``InputProcessor``: a request's prompt and constraint made ready for the engine, off its loop.

Everything here is per request and thread-safe (the tokenizer, the chat template, the
grammar cache), so any number of threads may prepare requests while one thread steps the
engine. Each phase is bounded: a prompt over the engine's length is refused from its byte
length where the tokenizer allows (``prompt_bounds``) or from its token count, tokenising
slower than ``tokenize_seconds`` is refused, and a grammar compiles within
``grammar_compile_seconds`` or is refused (``grammar_probe``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from conveyor.engine.inputs.chat_kwargs import check_template_kwargs
from conveyor.engine.inputs.errors import PROMPT_TOO_LONG, InputRejected
from conveyor.engine.inputs.prompt_bounds import bytes_per_token_bound, min_tokens
from conveyor.engine.inputs.text_checks import check_text, check_texts
from conveyor.engine.inputs.tool_arguments import with_text_arguments
from conveyor.engine.pooling.pooler import EngineEmbedding
from conveyor.engine.pooling.pooling_state import PoolingState
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured.structured_outputs import CompiledGrammar, StructuredOutputManager, check_tools

MAX_CHAT_MESSAGES = 1024

Prompt = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class PreparedInput:
    """A request's inputs, ready: its token ids (and text), the sampling it runs with (an
    embedding request's is rewritten to one greedy token), its pooling state and its compiled
    grammar. ``LLMEngine.add_request`` takes it, once, in place of a raw prompt."""

    token_ids: list[int]
    text: str | None
    source_params: SamplingParams  # what the caller asked for
    params: SamplingParams
    pooling: PoolingState | None
    grammar: CompiledGrammar | None
    seconds: float  # how long preparing it took


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_request_tokens: int,
        length_limits: str,
        structured: StructuredOutputManager,
        embedding: EngineEmbedding,
        tokenize_seconds: float | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_request_tokens = max_request_tokens
        self._length_limits = length_limits  # what makes max_request_tokens, for the refusal
        self.structured = structured
        self.embedding = embedding
        self.tokenize_seconds = tokenize_seconds
        self.max_bytes_per_token = bytes_per_token_bound(tokenizer)

    def resolve(self, prompt: Prompt | PreparedInput, params: SamplingParams | None) -> PreparedInput:
        """What ``add_request`` runs: ``prompt`` prepared for ``params`` (default ones when None), or
        a ``PreparedInput`` as it is, which runs with the params it was prepared for."""
        if isinstance(prompt, PreparedInput):
            if params is not None and params is not prompt.source_params:
                raise ValueError("a PreparedInput runs with the params it was prepared for")
            return prompt
        return self.prepare(prompt, params if params is not None else SamplingParams())

    def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedInput:
        """``prompt`` for ``params``, ready; ``ValueError`` (``InputRejected`` with its code)
        naming what is wrong."""
        begin = time.perf_counter()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        source = params
        params, pooling = self.embedding.request(params)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            raise ValueError(
                f"logit_bias token id {bad[0]} is not in the vocabulary [0, {self.vocab_size})"
                + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            )
        if pooling is not None and pooling.scorer is not None:
            ids, text = self.tokenize_pair(prompt), None
        else:
            ids, text = self.tokenize(prompt)
        if len(ids) >= self.max_request_tokens:
            raise self._too_long(f"{len(ids)} tokens")
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        return PreparedInput(ids, text, source, params, pooling, grammar, time.perf_counter() - begin)

    def tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids (and the text, when there is one) of a prompt in any accepted form."""
        if isinstance(prompt, dict):
            keys = set(prompt) & {"prompt", "prompt_token_ids", "messages"}
            if len(keys) != 1:
                raise ValueError("a dict prompt needs exactly one of 'prompt', 'prompt_token_ids', 'messages'")
            key = keys.pop()
            tools = prompt.get("tools")
            if (tools is not None or "chat_template_kwargs" in prompt) and key != "messages":
                raise ValueError("tools and chat_template_kwargs go with messages (the chat template renders them)")
            if key == "messages":
                text = self._apply_chat_template(prompt["messages"], tools, prompt.get("chat_template_kwargs"))
                return self._encode(text, "messages", add_special_tokens=False), text
            prompt = prompt[key]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            check_text(prompt, "prompt")
            return self._encode(prompt, "prompt", add_special_tokens=True), prompt
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt_token_ids is empty")
            if len(prompt) >= self.max_request_tokens:
                raise self._too_long(f"{len(prompt)} tokens")
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt token id {t!r} is not in the vocabulary [0, {self.vocab_size})")
            return list(prompt), None
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def tokenize_pair(self, prompt: Prompt) -> list[int]:
        """A score request's token ids: ``{"text_pair": [text_1, text_2]}`` as the model's
        scoring head puts a pair into one prompt (``conveyor.engine.pooling.scoring``)."""
        pair = prompt.get("text_pair") if isinstance(prompt, dict) and set(prompt) == {"text_pair"} else None
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise ValueError('a score request\'s prompt is {"text_pair": [text_1, text_2]}, two strings')
        for field, text in zip(("text_1", "text_2"), pair, strict=True):
            if not text:
                raise ValueError(f"{field} is empty")
            check_text(text, field)
        size = sum(len(t.encode("utf-8")) for t in pair)
        at_least = sum(min_tokens(t, self.max_bytes_per_token) for t in pair)
        if at_least >= self.max_request_tokens:
            raise self._too_long(f"at least {at_least} tokens ({size} bytes)")
        head = self.embedding.score
        assert not isinstance(head, str)  # a scorer was given: the head exists
        begin = time.perf_counter()
        try:
            ids = head.encode(self.tokenizer, pair[0], pair[1])
        except Exception as exc:  # tokenizers raise several types; one request's problem, not the batch's
            raise ValueError(f"the tokenizer cannot encode the pair: {type(exc).__name__}: {exc}") from None
        took = time.perf_counter() - begin
        if self.tokenize_seconds is not None and took > self.tokenize_seconds:
            raise InputRejected(
                f"the pair took {took:.1f} s to tokenize, over CONVEYOR_TOKENIZE_SECONDS={self.tokenize_seconds:g}",
                PROMPT_TOO_LONG,
            )
        return ids

    def _too_long(self, size: str) -> InputRejected:
        return InputRejected(
            f"prompt is {size}; this engine takes at most {self.max_request_tokens - 1} ({self._length_limits}) "
            "to leave room for one generated token",
            PROMPT_TOO_LONG,
        )

    def _encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        at_least = min_tokens(text, self.max_bytes_per_token)
        if at_least >= self.max_request_tokens:
            raise self._too_long(f"at least {at_least} tokens ({len(text.encode('utf-8'))} bytes)")
        begin = time.perf_counter()
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # tokenizers raise several types; one request's problem, not the batch's
            raise ValueError(f"the tokenizer cannot encode the {field}: {type(exc).__name__}: {exc}") from None
        took = time.perf_counter() - begin
        if self.tokenize_seconds is not None and took > self.tokenize_seconds:
            raise InputRejected(
                f"the {field} took {took:.1f} s to tokenize, over CONVEYOR_TOKENIZE_SECONDS={self.tokenize_seconds:g}",
                PROMPT_TOO_LONG,
            )
        if not ids:
            raise ValueError(f"the {field} encodes to no tokens")
        return ids

    def encode_delimiter(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        assert isinstance(ids, list)
        return ids

    def _apply_chat_template(self, messages: Any, tools: Any = None, kwargs: Any = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise ValueError(f"messages has {len(messages)} entries; at most {MAX_CHAT_MESSAGES}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            content = m.get("content")
            if not isinstance(content, (str, list)) and content is not None:
                raise ValueError(f"messages[{i}].content must be a string or a list of parts")
            check_texts(m, f"messages[{i}]")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        checked: list[Any] | None = check_tools(tools) if tools else None
        extra = check_template_kwargs(kwargs)
        try:
            text = self._render(messages, checked, extra)
        except Exception as exc:  # template errors come in many types
            as_text = with_text_arguments(messages)
            if as_text is None:
                raise ValueError(f"the chat template rejected these messages: {exc}") from exc
            try:  # a template that concatenates the arguments as text (DeepSeek-V3.1)
                text = self._render(as_text, checked, extra)
            except Exception:
                raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        return text

    def _render(self, messages: list[Any], tools: list[Any] | None, extra: dict[str, Any]) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **extra
        )
        assert isinstance(text, str)  # tokenize=False: the rendered text
        return text
