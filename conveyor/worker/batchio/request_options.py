"""A job's request options: what applies to every line of its input unless the line says
otherwise.

- ``chat``: whether a plain ``prompt`` row is rendered through the model's chat template (as
  one user message). ``None`` (the default, "auto") renders it when the model's tokenizer has
  a chat template, which is what an instruct model expects; ``False`` sends the text as it
  is; ``True`` asks for the template (a row fails, naming why, when the model has none).
  OpenAI Batch ``/v1/completions`` lines are never rendered: they ask for a completion.
- ``system_prompt``: a system message put first in every chat request (a ``messages`` row,
  a ``prompt`` row rendered as chat, an OpenAI Batch chat line) whose messages do not start
  with a system message of their own.
- ``defaults``: request-body fields (``max_tokens, temperature, top_p, seed, stop, n,
  response_format``) laid under each line's own: a line's field wins.
- ``endpoint``: set for a batch created through the HTTP API (``POST /v1/batches``): every
  line must be an OpenAI Batch request whose ``url`` is this endpoint; a plain row or another
  endpoint's line is that line's error, as OpenAI answers it. Not a submission field.
- ``output_expires_after``: set for a batch of the HTTP API: how long, in seconds, each of its
  output and error files is kept after it is written (``output_expires_after``, else the
  deployment's default when the batch was created); None keeps them. Not a submission field.

Stored with the job (``jobs.request_options``) and applied where its input is read, so the
queued path and ``conveyor run`` read a line the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.worker.batchio.body_errors import InvalidRequest
from conveyor.worker.batchio.request_body import COMPLETIONS, LINE_ENDPOINTS, sampling_from_body
from conveyor.worker.core.limits import InputLimits

# The body fields a job may set for all its lines (the CLI's sampling flags).
DEFAULT_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "n", "response_format")
# Every option by its flat name (``Client.submit``'s keywords, a broker submission's fields).
OPTION_FIELDS = ("chat", "system_prompt", *DEFAULT_FIELDS)
MAX_SYSTEM_PROMPT_CHARS = 100_000
# ``chat`` as stored and shown: None is auto (the chat template when the model has one).
CHAT_MODES: dict[bool | None, str] = {None: "auto", True: "on", False: "off"}
_CHAT_VALUES = {mode: value for value, mode in CHAT_MODES.items()}


@dataclass(frozen=True)
class RequestOptions:
    chat: bool | None = None  # None: auto (the chat template when the model has one)
    system_prompt: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    endpoint: str | None = None  # an API batch's (or a Message Batch's): the one url its lines may ask for
    output_expires_after: int | None = None  # an API batch's output files' lifetime, in seconds

    @property
    def chat_mode(self) -> str:
        """``auto``, ``on`` or ``off``: how the job object shows ``chat``."""
        return CHAT_MODES[self.chat]

    def check(self, limits: InputLimits) -> RequestOptions:
        """``self``, or ``ValueError`` naming the option that is wrong."""
        if self.chat is not None and not isinstance(self.chat, bool):
            raise ValueError(f"chat must be true, false or null (auto), got {self.chat!r:.40}")
        sp = self.system_prompt
        if sp is not None and (not isinstance(sp, str) or not sp.strip() or len(sp) > MAX_SYSTEM_PROMPT_CHARS):
            raise ValueError(f"system_prompt must be non-empty text of at most {MAX_SYSTEM_PROMPT_CHARS} characters")
        if self.endpoint is not None and self.endpoint not in LINE_ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(LINE_ENDPOINTS)}, got {self.endpoint!r:.80}")
        keep = self.output_expires_after
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"output_expires_after must be a positive number of seconds, got {keep!r:.40}")
        if not isinstance(self.defaults, dict):
            raise ValueError("the sampling defaults must be an object")
        unknown = sorted(set(self.defaults) - set(DEFAULT_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown sampling default(s) {', '.join(unknown)}; the fields are {', '.join(DEFAULT_FIELDS)}"
            )
        try:  # the same checks a line's own fields get
            sampling_from_body(self.defaults, COMPLETIONS, limits, strict=True)
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None
        return self

    def body_with_defaults(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` with the job's defaults under its own fields (a line giving
        ``max_completion_tokens`` or ``structured_outputs`` keeps them instead of the
        default ``max_tokens`` or ``response_format``)."""
        if not self.defaults:
            return dict(body)
        merged = {k: v for k, v in self.defaults.items() if body.get(k) is None}
        if body.get("max_completion_tokens") is not None:
            merged.pop("max_tokens", None)
        if body.get("structured_outputs") is not None:
            merged.pop("response_format", None)
        return {**body, **merged}

    def with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the system prompt first, unless they start with a system message."""
        if self.system_prompt is None or (messages and messages[0].get("role") == "system"):
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def to_json(self) -> dict[str, Any] | None:
        """What the job stores (None when every option is at its default)."""
        if self == RequestOptions():
            return None
        data: dict[str, Any] = {"chat": self.chat_mode}
        if self.system_prompt is not None:
            data["system_prompt"] = self.system_prompt
        if self.defaults:
            data["defaults"] = dict(self.defaults)
        if self.endpoint is not None:
            data["endpoint"] = self.endpoint
        if self.output_expires_after is not None:
            data["output_expires_after"] = self.output_expires_after
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> RequestOptions:
        if not data:
            return cls()
        chat = _CHAT_VALUES[data.get("chat") or "auto"]
        return cls(
            chat=chat,
            system_prompt=data.get("system_prompt"),
            defaults=dict(data.get("defaults") or {}),
            endpoint=data.get("endpoint"),
            output_expires_after=data.get("output_expires_after"),
        )

    @classmethod
    def from_fields(
        cls, *, chat: bool | None = None, system_prompt: str | None = None, **defaults: Any
    ) -> RequestOptions:
        """Options from flat fields (``Client.submit``'s keywords, a broker submission's
        fields): the sampling defaults by their body names, None meaning not given."""
        return cls(
            chat=chat, system_prompt=system_prompt, defaults={k: v for k, v in defaults.items() if v is not None}
        )

    def shown(self) -> dict[str, Any]:
        """As the job object shows the options (``Job.request_options_shown``)."""
        return {"chat": CHAT_MODES[self.chat], "system_prompt": self.system_prompt, "defaults": dict(self.defaults)}
