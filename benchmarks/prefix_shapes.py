"""Deterministic batch inputs of the shapes prefix grouping is for (and those it must not
slow down): many questions per document, few-shot prompts, one shared system prompt, a few
very long documents; in prefix order or shuffled. Each line is an OpenAI Batch chat line.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_WORDS = tuple(
    [
        "river",
        "stone",
        "lantern",
        "quiet",
        "harbour",
        "copper",
        "meadow",
        "signal",
        "orchard",
        "velvet",
        "ember",
        "glacier",
        "thimble",
        "compass",
        "saddle",
        "thunder",
        "pepper",
        "marble",
        "willow",
        "canyon",
        "falcon",
        "ledger",
        "mosaic",
        "nectar",
        "prism",
        "quartz",
        "raven",
        "summit",
        "timber",
        "umbra",
        "vessel",
        "whisper",
        "yonder",
        "zephyr",
        "anchor",
        "bramble",
        "cinder",
        "dapple",
    ]
)


def words(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


@dataclass(frozen=True)
class Shape:
    name: str
    lines: list[dict[str, Any]]


def _line(custom_id: str, system: str, user: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _build(name: str, items: list[tuple[str, str, str]], shuffled: bool, seed: int, max_tokens: int) -> Shape:
    """``items``: (system, shared document, own question) per line."""
    order = list(range(len(items)))
    if shuffled:
        random.Random(seed + 1).shuffle(order)
    lines = []
    for i in order:
        system, shared, own = items[i]
        lines.append(_line(f"{name}-{i}", system, f"{shared}\n\nQuestion: {own}", max_tokens))
    return Shape(name + ("-shuffled" if shuffled else ""), lines)


def many_questions(
    docs: int, questions: int, doc_bytes: int, *, shuffled: bool, seed: int = 0, max_tokens: int = 4
) -> Shape:
    rng = random.Random(seed)
    system = "Answer from the document only."
    items = []
    for d in range(docs):
        doc = f"Document {d}: " + words(rng, doc_bytes)
        items += [(system, doc, words(rng, 40)) for _ in range(questions)]
    return _build("questions", items, shuffled, seed, max_tokens)


def few_shot(n: int, shot_bytes: int, *, shuffled: bool, seed: int = 0, max_tokens: int = 4) -> Shape:
    rng = random.Random(seed)
    shots = "Examples:\n" + words(rng, shot_bytes)
    items = [("Follow the examples.", shots, words(rng, 40)) for _ in range(n)]
    return _build("fewshot", items, shuffled, seed, max_tokens)


def one_system_prompt(n: int, system_bytes: int, *, shuffled: bool, seed: int = 0, max_tokens: int = 4) -> Shape:
    rng = random.Random(seed)
    system = "You are helpful. " + words(rng, system_bytes)
    items = [(system, "", words(rng, 60)) for _ in range(n)]
    return _build("system", items, shuffled, seed, max_tokens)


def long_documents(
    docs: int, questions: int, doc_bytes: int, *, shuffled: bool, seed: int = 0, max_tokens: int = 4
) -> Shape:
    shape = many_questions(docs, questions, doc_bytes, shuffled=shuffled, seed=seed, max_tokens=max_tokens)
    return Shape(shape.name.replace("questions", "longdocs"), shape.lines)
