"""Reasoning models' thinking inside the engine: a thinking budget, and structured outputs that
constrain the answer only.

A request whose ``SamplingParams.thinking_delimiters`` names its model's thinking block (the
texts that open and close it: ``("<think>", "</think>")`` for Qwen3, QwQ and DeepSeek-R1; the
Harmony channel headers for gpt-oss) gets a ``ThinkingGate`` in its grammar slot
(``Request.grammar``), fed every kept token like a grammar matcher:

- it knows from the prompt whether the template opened the block already (DeepSeek-R1's
  template ends the prompt with ``<think>``) and sees the model open it otherwise;
- with ``thinking_token_budget`` N, once N thinking tokens are generated it forces the closing
  sequence token by token (every other token masked out), so the line goes on to answer;
- the request's structured-output matcher, if any, sees only the tokens after the block
  closed: the grammar constrains the answer, not the thinking.

Like a matcher it only ever sees the tokens the request keeps, so preemption (tokens
recomputed, not re-sampled) and the prefix cache (which serves prompt tokens only) leave it in
step. A request without delimiters gets its plain matcher (or none): nothing changes for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance

    from conveyor.engine.sampling_params import SamplingParams
    from conveyor.engine.structured.structured_outputs import GrammarMatcher

# The delimiters a thinking budget uses when a request names none (the ``<think>`` family).
DEFAULT_DELIMITERS = ("<think>", "</think>")


@dataclass(frozen=True)
class Delimiters:
    """The token ids that open and close a thinking block."""

    start: tuple[int, ...]
    end: tuple[int, ...]


def _ends_with(tokens: Sequence[int], seq: tuple[int, ...]) -> bool:
    n = len(seq)
    return len(tokens) >= n and tuple(tokens[-n:]) == seq


def _last_index(tokens: Sequence[int], seq: tuple[int, ...]) -> int:
    """The index just past the last occurrence of ``seq`` in ``tokens``, or -1."""
    n = len(seq)
    for end in range(len(tokens), n - 1, -1):
        if tuple(tokens[end - n : end]) == seq:
            return end
    return -1


class ThinkingGate:
    """One request's place in or after its thinking block (see the module's docstring)."""

    __slots__ = ("budget", "delimiters", "forced", "inner", "recent", "state", "thought")

    BEFORE, THINKING, ANSWER = "before", "thinking", "answer"

    def __init__(
        self,
        delimiters: Delimiters,
        prompt_ids: Sequence[int],
        budget: int | None,
        inner: GrammarMatcher | None,
    ) -> None:
        self.delimiters, self.budget, self.inner = delimiters, budget, inner
        opened, closed = _last_index(prompt_ids, delimiters.start), _last_index(prompt_ids, delimiters.end)
        # The template opened the block (and did not close it: enable_thinking=false closes it).
        self.state = self.THINKING if opened > closed else (self.ANSWER if closed > opened else self.BEFORE)
        self.thought = 0  # thinking tokens generated so far
        self.forced = 0  # how many tokens of the closing sequence were forced so far
        self.recent: list[int] = list(prompt_ids[-max(len(delimiters.start), len(delimiters.end)) :])

    def forced_token(self) -> int | None:
        """The one token the next step may sample: the closing sequence under a spent budget,
        or the opening one of a request whose answer has a grammar (it must think first, then
        answer under the grammar, as the template's format has it)."""
        if self.state == self.THINKING and self.budget is not None and (self.forced or self.thought >= self.budget):
            return self.delimiters.end[self.forced]
        if self.state == self.BEFORE and self.inner is not None:
            return self.delimiters.start[self.forced]
        return None

    @property
    def matcher(self) -> llguidance.LLMatcher | None:
        """The grammar's matcher while it constrains the output (the answer), else None."""
        return self.inner.matcher if self.state == self.ANSWER and self.inner is not None else None

    def accept(self, token_id: int) -> bool:
        """Advance by one kept token; True once the answer's grammar is complete."""
        if self.state == self.ANSWER:
            return self.inner.accept(token_id) if self.inner is not None else False
        forcing = self.forced_token() is not None
        window = max(len(self.delimiters.start), len(self.delimiters.end))
        self.recent = [*self.recent, token_id][-window:]
        self.forced = self.forced + 1 if forcing else 0
        if self.state == self.BEFORE:
            if _ends_with(self.recent, self.delimiters.start) or self.forced == len(self.delimiters.start):
                self.state, self.forced = self.THINKING, 0
            return False
        if _ends_with(self.recent, self.delimiters.end) or self.forced == len(self.delimiters.end):
            self.state, self.forced = self.ANSWER, 0
        elif not forcing:
            self.thought += 1
        return False


def delimiter_ids(encode: Callable[[str], list[int]], delimiters: tuple[str, str]) -> Delimiters:
    """The delimiters' token ids (``ValueError`` if either encodes to nothing)."""
    start, end = (tuple(encode(text)) for text in delimiters)
    if not start or not end:
        raise ValueError(f"thinking_delimiters {delimiters!r}: each must encode to at least one token")
    return Delimiters(start, end)


def gate_for(
    params: SamplingParams,
    prompt_ids: Sequence[int],
    grammar: GrammarMatcher | None,
    encode: Callable[[str], list[int]],
) -> ThinkingGate | GrammarMatcher | None:
    """What goes in a new request's grammar slot: a ``ThinkingGate`` when it names thinking
    delimiters or a budget, else its plain matcher (or None)."""
    names = params.thinking_delimiters
    if names is None and params.thinking_token_budget is None:
        return grammar
    pair = (names[0], names[1]) if names is not None else DEFAULT_DELIMITERS
    return ThinkingGate(delimiter_ids(encode, pair), prompt_ids, params.thinking_token_budget, grammar)
