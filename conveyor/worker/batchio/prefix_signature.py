"""A request's prefix signature: what lets intake put lines that share a long prompt prefix
next to each other, without a tokenizer.

The request is rendered as canonical text in the order its prompt will hold it: the tools
first (chat templates put them in the system block, ahead of the messages), then each message
as its role and content, or the system prompt and the prompt. ``response_format`` is not
part of it: the engine enforces it with a grammar, not with prompt text. The text is hashed
at several depths (its first 64 bytes, 128, and each power of two up to 64 KiB), each keyed by the
owner's cache salt and the model, so sorting by the digests in turn puts lines together
that share a prefix of that depth (partial overlap included: two documents behind one long
system prompt share the first digests), and two owners' equal prompts never share a group,
as they never share prefix-cache blocks.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from conveyor.worker.batchio.records import ParsedRequest

DEPTHS = tuple(64 << i for i in range(11))  # 64 B to 64 KiB
DIGEST_BYTES = 8
SIGNATURE_BYTES = DIGEST_BYTES * len(DEPTHS)


@dataclass(frozen=True)
class PrefixSignature:
    """``digests``: one per depth of ``DEPTHS``, concatenated (they sort as bytes);
    ``length``: the canonical text's bytes."""

    digests: bytes
    length: int

    def digest(self, level: int) -> bytes:
        """The digest of the first ``DEPTHS[level]`` bytes."""
        return self.digests[level * DIGEST_BYTES : (level + 1) * DIGEST_BYTES]


def shared_levels(a: bytes, b: bytes) -> int:
    """How many leading depths two signatures' ``digests`` agree on (0 to ``len(DEPTHS)``)."""
    level = 0
    while (
        level < len(DEPTHS)
        and a[level * DIGEST_BYTES : (level + 1) * DIGEST_BYTES] == b[level * DIGEST_BYTES : (level + 1) * DIGEST_BYTES]
    ):
        level += 1
    return level


def shared_bytes(levels: int, length_a: int, length_b: int) -> int:
    """The prefix two texts are known to share from their agreeing ``levels``: a lower bound."""
    if levels == 0:
        return 0
    return min(DEPTHS[levels - 1], length_a, length_b)


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def canonical_prompt(request: ParsedRequest) -> bytes:
    """The request's prompt as canonical text, in prompt order (see the module)."""
    parts: list[str] = []
    if request.tools is not None:
        parts.append("\x1dtools\x1f" + _text(request.tools.tools))
    if request.messages is not None:
        for message in request.messages:
            parts.append(f"\x1e{message.get('role', '')}\x1f")
            parts.append(_text(message.get("content", "")))
            extra = {k: v for k, v in message.items() if k not in ("role", "content")}
            if extra:  # tool calls, names: after the content, as templates render them
                parts.append("\x1f" + _text(extra))
    elif request.pairs is not None:
        # A score or rerank line's pairs, in order: pairs that share a query share a prefix.
        for first, second in request.pairs:
            parts.append(first + "\x1f" + second + "\x1e")
    else:
        if request.system_prompt is not None:
            parts.append("\x1esystem\x1f" + request.system_prompt + "\x1e")
        # An embeddings line's inputs are prompts of their own; its first one leads the signature.
        prompts: list[str | list[int] | None] = [*request.inputs] if request.inputs else [request.prompt]
        for prompt in prompts:
            if isinstance(prompt, list):  # token ids: their decimal text keeps the prefix relation
                parts.append("\x1dids\x1f" + "".join(f"{t}," for t in prompt))
            else:
                parts.append((prompt or "") + ("\x1e" if request.inputs else ""))
    return "".join(parts).encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=64)
def _keyed_hasher(key: str) -> Any:
    return hashlib.blake2b(digest_size=DIGEST_BYTES, key=hashlib.sha256(key.encode("utf-8")).digest())


def signature_of_text(text: bytes, key: str) -> PrefixSignature:
    """The signature of canonical ``text`` under ``key`` (the cache salt and the model)."""
    hasher = _keyed_hasher(key).copy()
    digests = bytearray()
    start = 0
    for level, depth in enumerate(DEPTHS):
        if depth >= len(text):  # this depth and every deeper one cover the whole text
            hasher.update(text[start:])
            digests += hasher.digest() * (len(DEPTHS) - level)
            break
        hasher.update(text[start:depth])
        start = depth
        digests += hasher.copy().digest()
    return PrefixSignature(bytes(digests), len(text))


def prefix_signature(request: ParsedRequest, key: str) -> PrefixSignature:
    return signature_of_text(canonical_prompt(request), key)


def grouping_key(cache_salt: str | None, model: str) -> str:
    """The key signatures are made under: lines of different owners or models never group."""
    return f"{cache_salt or ''}\x00{model}"
