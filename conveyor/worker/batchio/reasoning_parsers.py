"""Reasoning parsers: a reasoning model's output split into its thinking and its answer.

One interface (``ReasoningParser``), one parser per output format, chosen per worker
(``CONVEYOR_REASONING_PARSER``, as vLLM's ``--reasoning-parser``) or, by default, from the
model's family and chat template (``choose_parser``):

- ``think``: ``<think>…</think>`` (Qwen3, QwQ, DeepSeek-R1 and its distills). A template that
  opens the block in the prompt (QwQ, DeepSeek-R1) leaves only ``…</think>answer`` to the
  output; a line cut short while thinking (``length``) has all its text as reasoning.
- ``harmony``: gpt-oss's channels. ``analysis`` is the reasoning, ``final`` the answer, and
  ``commentary`` messages addressed ``to=functions.NAME`` are tool calls (Hermes-shaped
  ``<tool_call>`` text is produced for them, so the chat tool reader takes them as any other).
- ``gemma4``: Gemma 4's ``<|channel>thought\\n…<channel|>`` block in front of the answer; its
  tool calls, ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`` as its chat template
  writes them (keys bare, strings between ``<|"|>``), become Hermes-shaped ``<tool_call>`` text
  as Harmony's do.

A parser tells the engine what it needs (``delimiters``: the texts that open and close the
thinking, for the thinking budget and for structured outputs that constrain the answer only;
``keeps_special_tokens``: its markers are special tokens the detokenizer must not drop) and how
``reasoning_effort`` maps onto the template (only Harmony defines it; the others refuse it).

Forward passes of new families plug in here by naming a parser in ``FAMILY_PARSERS`` (their
``model_type``) or by their template containing the parser's marker (``TEMPLATE_MARKERS``).
Everything here is pure text: no tokenizer, no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from conveyor.worker.batchio.body_errors import InvalidRequest

REASONING_EFFORTS = ("low", "medium", "high")


@dataclass(frozen=True)
class ReasoningSplit:
    """One sample's text parted: the thinking (None when there was none) and the answer."""

    reasoning: str | None
    content: str


class ReasoningParser:
    """The interface every format implements (the base is the no-reasoning parser)."""

    name: ClassVar[str] = "none"
    delimiters: ClassVar[tuple[str, str] | None] = None
    keeps_special_tokens: ClassVar[bool] = False

    def split(self, text: str, *, opened_in_prompt: bool = False) -> ReasoningSplit:
        """``text`` as reasoning and content. ``opened_in_prompt``: the rendered prompt ended
        inside an open thinking block (the template opened it)."""
        return ReasoningSplit(None, text)

    def opened_in_prompt(self, prompt: str | None) -> bool:
        """Whether a rendered prompt leaves the thinking block open (its last opener is not
        followed by a closer)."""
        if prompt is None or self.delimiters is None:
            return False
        start, end = self.delimiters
        return prompt.rfind(start) > prompt.rfind(end) if start in prompt else False

    def template_kwargs_for_effort(self, effort: str) -> dict[str, Any]:
        """What ``reasoning_effort`` sets in the chat template; refused where the family has no
        such control."""
        raise InvalidRequest(
            "unsupported",
            f"reasoning_effort is defined for gpt-oss (Harmony) models only; this worker's reasoning parser "
            f"is {self.name!r}: use thinking_token_budget or chat_template_kwargs (enable_thinking) instead",
            "reasoning_effort",
        )


class ThinkParser(ReasoningParser):
    name = "think"
    delimiters = ("<think>", "</think>")

    def split(self, text: str, *, opened_in_prompt: bool = False) -> ReasoningSplit:
        start, end = self.delimiters or ("", "")
        head = text.lstrip()
        if head.startswith(start):
            head = head[len(start) :]
        elif opened_in_prompt or end in text:  # DeepSeek-R1's distills write no opener either
            head = text
        else:  # (the newlines GLM's template puts after a block its prompt closed are not the answer's)
            return ReasoningSplit(None, text.lstrip("\n"))
        if end not in head:  # cut short while thinking
            return ReasoningSplit(head.strip("\n") or None, "")
        thought, answer = head.split(end, 1)
        return ReasoningSplit(thought.strip("\n") or None, answer.lstrip("\n"))


# One Gemma 4 tool call as its chat template writes it: the name, then the arguments' braces.
_GEMMA4_CALL = re.compile(r"<\|tool_call>call:([\w.\-]+)(\{.*?\})<tool_call\|>", re.DOTALL)


class Gemma4Parser(ReasoningParser):
    name = "gemma4"
    delimiters = ("<|channel>thought", "<channel|>")
    keeps_special_tokens = True
    # (``<|tool_response>``: where the model stops after its calls to wait for their results)
    _END_OF_TURN = ("<turn|>", "<end_of_turn>", "<eos>", "<|tool_response>")

    def split(self, text: str, *, opened_in_prompt: bool = False) -> ReasoningSplit:
        start, end = self.delimiters or ("", "")
        for marker in self._END_OF_TURN:
            text = text.replace(marker, "")
        head = text.lstrip()
        if head.startswith(start):
            head, opened_in_prompt = head[len(start) :], True
        elif not opened_in_prompt:
            return ReasoningSplit(None, _gemma4_tool_calls(text))
        if end not in head:
            return ReasoningSplit(head.strip("\n") or None, "")
        thought, answer = head.split(end, 1)
        return ReasoningSplit(thought.strip("\n") or None, _gemma4_tool_calls(answer.lstrip("\n")))


def _gemma4_tool_calls(text: str) -> str:
    """Each complete Gemma 4 call whose arguments read as JSON, as Hermes ``<tool_call>`` text
    (a call that does not read stays as the model wrote it, for the tool reader to leave as content)."""

    def hermes(m: re.Match[str]) -> str:
        args = gemma4_arguments(m[2])
        if args is None:
            return m[0]
        return "<tool_call>" + json.dumps({"name": m[1], "arguments": args}, ensure_ascii=False) + "</tool_call>"

    return _GEMMA4_CALL.sub(hermes, text)


_GEMMA4_STRING = '<|"|>'
_BARE_KEY = re.compile(r'([{,]\s*)([^\s{}\[\],:"]+)\s*:')
_BARE_NONE = re.compile(r"(?<=[:\[,])\s*None\s*(?=[,}\]])")


def gemma4_arguments(text: str) -> dict[str, Any] | None:
    """Gemma 4's argument syntax (its template's ``format_argument``: keys bare, strings between
    ``<|"|>``, booleans ``true``/``false``, numbers as they are, Python's ``None``) as a dict,
    or None when it does not read."""
    parts = text.split(_GEMMA4_STRING)
    if len(parts) % 2 == 0:  # a string left open
        return None
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(json.dumps(part, ensure_ascii=False))
        else:
            out.append(_BARE_NONE.sub("null", _BARE_KEY.sub(r'\1"\2":', part)))
    try:
        value = json.loads("".join(out))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# One Harmony message: an optional ``<|start|>role`` header, the channel (and recipient,
# constraint) header, the body up to <|end|>, <|call|>, <|return|> or the end of the text.
_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>(?P<role>[^<]*))?<\|channel\|>(?P<header>[^<]*)(?:<\|constrain\|>(?P<constrain>[^<]*))?"
    r"<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)",
    re.DOTALL,
)
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_-]{1,64})")


class HarmonyParser(ReasoningParser):
    """gpt-oss: ``<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final
    <|message|>…<|return|>``; a tool call is ``<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>{…}<|call|>`` (the recipient may sit in the role header)."""

    name = "harmony"
    delimiters = ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>")
    keeps_special_tokens = True

    def split(self, text: str, *, opened_in_prompt: bool = False) -> ReasoningSplit:
        if "<|channel|>" not in text:
            return ReasoningSplit(None, text.replace("<|return|>", "").replace("<|end|>", ""))
        thoughts: list[str] = []
        answer: list[str] = []
        for m in _HARMONY_MESSAGE.finditer(text):
            header = f"{m['role'] or ''} {m['header']}"
            channel = m["header"].split()[0] if m["header"].split() else ""
            recipient = _RECIPIENT.search(header)
            if recipient is not None:
                answer.append(self._tool_call(recipient.group(1), m["body"]))
            elif channel == "analysis":
                thoughts.append(m["body"])
            elif channel in ("final", "commentary"):
                answer.append(m["body"])
        reasoning = "\n".join(t.strip("\n") for t in thoughts) or None
        return ReasoningSplit(reasoning, "".join(answer))

    @staticmethod
    def _tool_call(name: str, arguments: str) -> str:
        try:
            args: Any = json.loads(arguments)
        except ValueError:
            args = arguments
        return "<tool_call>" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "</tool_call>"

    def template_kwargs_for_effort(self, effort: str) -> dict[str, Any]:
        return {"reasoning_effort": effort}  # gpt-oss's template writes "Reasoning: <effort>"


PARSERS: dict[str, type[ReasoningParser]] = {
    "none": ReasoningParser,
    "think": ThinkParser,
    "harmony": HarmonyParser,
    "gemma4": Gemma4Parser,
}
# Aliases under vLLM's parser names, so a --reasoning-parser habit carries over.
ALIASES = {"qwen3": "think", "deepseek_r1": "think", "qwq": "think", "openai_gptoss": "harmony", "gpt_oss": "harmony"}
# model_type -> parser, for families whose format does not show in the template's text alone.
FAMILY_PARSERS = {"gpt_oss": "harmony", "gemma4": "gemma4", "gemma4_text": "gemma4"}
# A marker in the chat template's source -> parser (checked in this order).
TEMPLATE_MARKERS = (("<|channel|>", "harmony"), ("<|channel>", "gemma4"), ("<think>", "think"))


def parser_named(name: str) -> ReasoningParser:
    """The parser of a setting's value (``ValueError`` listing the names for a bad one)."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; one of auto, {', '.join(PARSERS)}, {', '.join(ALIASES)}")
    return PARSERS[key]()


def choose_parser(setting: str, model_type: str | None, chat_template: str | None) -> ReasoningParser:
    """The worker's parser: the setting's, or with ``auto`` the one its family or its chat
    template shows (``none`` when neither shows thinking)."""
    if setting != "auto":
        return parser_named(setting)
    if model_type in FAMILY_PARSERS:
        return parser_named(FAMILY_PARSERS[model_type])
    for marker, name in TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return parser_named(name)
    return ReasoningParser()
