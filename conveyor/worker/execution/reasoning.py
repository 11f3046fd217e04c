"""A worker's reasoning setup: which parser splits its model's thinking from the answer (the
setting, or the family and chat template), what a request's reasoning controls ask of the
engine, and how many of a sample's tokens were thinking.

Whether a think or tool-call marker survives decoding depends on the tokenizer: an added
token flagged ``special`` is dropped by ``skip_special_tokens``, and a parser reading the
text would then find no marker and split nothing. So the markers are looked up in the
tokenizer's added-token table: where any is special, the engine keeps special tokens in a chat
sample's text and the worker takes out every special token but those markers before the
parsers read it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.worker.batchio.reasoning_parsers import ReasoningParser, choose_parser
from conveyor.worker.batchio.records import ParsedRequest
from conveyor.worker.batchio.tool_parsers import MARKERS as TOOL_MARKERS


@dataclass(frozen=True)
class Reasoning:
    """What every item of a worker shares about reasoning."""

    parser: ReasoningParser
    # The message field the thinking goes to: ``reasoning`` (vLLM, OpenRouter) or
    # ``reasoning_content`` (DeepSeek's convention).
    field: str = "reasoning"
    default_budget: int | None = None  # CONVEYOR_THINKING_TOKEN_BUDGET
    end_ids: tuple[int, ...] = ()  # the closing delimiter's token ids, for counting
    # The special tokens taken out of a chat sample's text: all of them but the parsers'
    # markers, where some marker is special (empty otherwise: the engine drops them all).
    dropped: tuple[str, ...] = ()

    @classmethod
    def for_model(
        cls,
        setting: str,
        tokenizer: Any,
        model_type: str | None,
        *,
        field: str = "reasoning",
        budget: int | None = None,
    ) -> Reasoning:
        template = getattr(tokenizer, "chat_template", None)
        parser = choose_parser(setting, model_type, template if isinstance(template, str) else None)
        end_ids: tuple[int, ...] = ()
        if parser.delimiters is not None and tokenizer is not None:
            end_ids = tuple(tokenizer.encode(parser.delimiters[1], add_special_tokens=False))
        dropped: tuple[str, ...] = ()
        if tokenizer is not None and not parser.keeps_special_tokens:
            specials = _special_tokens(tokenizer)
            markers = {*(parser.delimiters or ()), *TOOL_MARKERS}
            if markers & specials:
                dropped = tuple(sorted(specials - markers, key=len, reverse=True))
        return cls(parser, field, budget, end_ids, dropped)

    def template_kwargs(self, req: ParsedRequest) -> dict[str, Any] | None:
        """The chat template's variables for ``req`` (``InvalidRequest`` for an effort the
        family does not define)."""
        kwargs = dict(req.template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs = {**self.parser.template_kwargs_for_effort(req.reasoning_effort), **kwargs}
        return kwargs or None

    def sampling(self, req: ParsedRequest) -> dict[str, Any]:
        """What the engine needs for ``req`` beyond its sampling fields: the budget (the line's,
        else the worker's default), the thinking delimiters when a budget or an answer grammar
        needs the engine to see the thinking, and the special tokens the parser reads."""
        extra: dict[str, Any] = {}
        if req.prompt is not None:
            return extra
        if self.dropped:
            extra["skip_special_tokens"] = False
        if self.parser.delimiters is None:
            return extra
        budget = req.sampling.get("thinking_token_budget", self.default_budget)
        if budget is not None:
            extra["thinking_token_budget"] = budget
        if budget is not None or req.sampling.get("structured_outputs") is not None:
            extra["thinking_delimiters"] = self.parser.delimiters
        if self.parser.keeps_special_tokens:
            extra["skip_special_tokens"] = False
        return extra

    def visible(self, text: str) -> str:
        """A chat sample's text as the parsers read it: the special tokens that are not markers
        taken out (the engine kept them all: see ``sampling``)."""
        for token in self.dropped:
            text = text.replace(token, "")
        return text

    def reasoning_tokens(self, token_ids: Sequence[int], reasoning: str | None) -> int:
        """How many of a sample's tokens were thinking: those before its closing delimiter;
        all of them when the thinking never closed."""
        if not reasoning:
            return 0
        n = len(self.end_ids)
        for i in range(len(token_ids) - n + 1):
            if n and tuple(token_ids[i : i + n]) == self.end_ids:
                return i
        return len(token_ids)


NO_REASONING = Reasoning(ReasoningParser())


def _special_tokens(tokenizer: Any) -> set[str]:
    """The texts of the tokens ``skip_special_tokens`` drops: the named special tokens and every
    added token flagged special."""
    specials = {t for t in getattr(tokenizer, "all_special_tokens", ()) if isinstance(t, str)}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials.update(t.content for t in added.values() if getattr(t, "special", False))
    return specials


def reasoning_of(host: Any, settings: Any) -> Reasoning:
    """The reasoning setup of an engine host under the worker's settings (cheap: a look at the
    chat template and one short encode)."""
    return Reasoning.for_model(
        settings.reasoning_parser,
        host.tokenizer,
        getattr(host, "model_type", None),
        field=settings.reasoning_field,
        budget=settings.thinking_token_budget,
    )
