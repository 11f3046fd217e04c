"""An assistant turn as the model generates it, taken from what the published template renders:
the conversation with that turn (thinking, answer, a tool call) less the prompt that leads to
it, up to the turn's end marker (where the model stops)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conveyor.worker.batchio.tool_parsers import MARKERS as TOOL_MARKERS
from tests.worker.templates.ours import reasoning_setup
from tests.worker.templates.published import ASK, CHECKPOINTS, WEATHER, thinking_controls

THOUGHT = "The user wants the weather in Paris."
ANSWER = "It is sunny and warm."
ARGUMENTS = {"city": "Paris"}
# Where a model stops: each family's end-of-turn (or end-of-call) token.
END_OF_TURN = (
    "<|im_end|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>", "<turn|>", "<|tool_response>",  # noqa: RUF001 - DeepSeek writes full-width bars
    "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "</s>", "<|end|>", "<|endoftext|>",
)  # fmt: skip
# The think and tool-call markers the parsers read, in any family's template.
MARKERS = ("<think>", "</think>", *TOOL_MARKERS, "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>')


@dataclass(frozen=True)
class Turn:
    body: dict[str, Any]  # the chat line that asks for this turn
    generated: str  # the turn's text as generated


def _controls(family: str, on: bool) -> dict[str, Any]:
    controls = thinking_controls(family)
    return dict(controls[1 if on else 0]) if controls else {}


def _kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if "reasoning_effort" in body:
        kwargs["reasoning_effort"] = body["reasoning_effort"]
    return kwargs


def _assistant(
    reasoning_key: str,
    call: dict[str, Any] | None,
    arguments: dict[str, Any],
    text_arguments: bool,
    content: bool,
    thought: bool,
) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", reasoning_key: THOUGHT, "content": ANSWER if content else None}
    if not thought:
        del turn[reasoning_key]
    if call is not None:
        sent = json.dumps(arguments) if text_arguments else arguments
        name = call["function"]["name"]
        turn["tool_calls"] = [{"id": "call12345", "type": "function", "function": {"name": name, "arguments": sent}}]
    return turn


def generated_turn(
    tok: Any,
    family: str,
    with_call: bool,
    tool: dict[str, Any] = WEATHER,
    arguments: dict[str, Any] = ARGUMENTS,
    thinking: tuple[bool, ...] = (True, False),
) -> Turn | None:
    """The turn the template renders (with a call of ``tool`` with ``arguments`` if asked),
    thinking on where the template renders a turn's thinking after the prompt that asks for it,
    else off (``thinking``: the settings tried, in order); None when the template renders no
    assistant turn that extends its own prompt."""
    reasoning_key = "thinking" if "message.thinking" in tok.chat_template else "reasoning_content"
    tools = [tool] if with_call else None
    for on in thinking:
        body: dict[str, Any] = {"messages": [ASK], **_controls(family, on)}
        if tools:
            body["tools"] = tools
        kwargs = _kwargs(body)
        prompt = tok.apply_chat_template([ASK], tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        # gpt-oss refuses an answer beside thinking and a call; DeepSeek-V3.1 takes text arguments.
        for text_arguments, content in ((False, True), (True, True), (False, False), (True, False)):
            turn = _assistant(reasoning_key, tool if with_call else None, arguments, text_arguments, content, on)
            try:
                full = tok.apply_chat_template([ASK, turn], tools=tools, tokenize=False, **kwargs)
            except Exception:  # this form is refused; the next may not be
                continue
            if full.startswith(prompt):
                return Turn(body, _up_to_end_of_turn(full[len(prompt) :], turn_ends(family)))
            turn_text = _after_empty_block(tok, family, prompt, full)
            if turn_text is not None:
                return Turn(body, _up_to_end_of_turn(turn_text, turn_ends(family)))
            break
    return None


def _after_empty_block(tok: Any, family: str, prompt: str, full: str) -> str | None:
    """Where the prompt ends in an empty thinking block that the template leaves out of a past
    turn (Gemma 4 with thinking off), the turn's text after the shared part; else None."""
    delimiters = reasoning_setup(tok, family).parser.delimiters
    shared = next(
        (i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), min(len(prompt), len(full))
    )
    rest = prompt[shared:]
    for delimiter in delimiters or ():
        rest = rest.replace(delimiter, "")
    return full[shared:] if delimiters and not rest.strip() and len(prompt) > shared else None


def turn_ends(family: str) -> tuple[str, ...]:
    """The tokens the model stops at: its published generation_config's EOS ids, else every
    family's end-of-turn tokens (gpt-oss's ``<|end|>`` ends a message, not a turn)."""
    path = CHECKPOINTS / family / "generation_config.json"
    if not path.is_file():
        return END_OF_TURN
    eos = json.loads(path.read_text())["eos_token_id"]
    # the published ids name tokens of the published table, not of our small tokenizer
    table = json.loads((CHECKPOINTS / family / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    return tuple(table[str(i)]["content"] for i in (eos if isinstance(eos, list) else [eos]))


def _up_to_end_of_turn(text: str, ends: tuple[str, ...]) -> str:
    found = [(text.index(m), m) for m in ends if m in text]
    if not found:
        return text
    at, marker = min(found)
    return text[: at + len(marker)]
