"""Incremental detokenization and stop strings.

Fast tokenizers use the tokenizers library's streaming decoder (``DecodeStream``), one Rust
call per token. Text that could still turn out to be the start of a stop string is held back
from the deltas until it cannot, so streamed deltas always add up to the final text.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    __slots__ = (
        "_count",
        "_emitted",
        "_floor",
        "_hold",
        "_ids",
        "_min_tokens",
        "_skip",
        "_stream",
        "_tokenizer",
        "stops",
        "text",
    )

    def __init__(
        self, tokenizer: Any, stops: tuple[str, ...], skip_special_tokens: bool = True, min_tokens: int = 0
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Fast tokenizers: their Rust tokenizer and a streaming decoder over it.
        self._stream: tuple[Tokenizer, DecodeStream] | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._stream = (backend, DecodeStream(skip_special_tokens=skip_special_tokens))
        self._ids: list[int] = []
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self._emitted = 0
        # min_tokens: a stop string must end past the text of the first min_tokens tokens
        # (``_floor`` characters), as vLLM has it.
        self._min_tokens = min_tokens
        self._count = 0
        self._floor = 0

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any (the text is then
        cut just before it)."""
        self._count += 1
        piece = self._step(token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        if self._count <= self._min_tokens:
            self._floor = len(self.text)
            return None
        if self.stops:
            best = -1
            hit = None
            for s in self.stops:
                i = self.text.find(s, max(search_from, self._floor - len(s) + 1))
                if i != -1 and (best == -1 or i < best):
                    best, hit = i, s
            if hit is not None:
                self.text = self.text[:best]
                return hit
        return None

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else len(self.text) - self._hold
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _step(self, token_id: int) -> str | None:
        if self._stream is not None:
            backend, stream = self._stream
            return stream.step(backend, token_id)
        # Slow tokenizers: decode the whole output and diff against what was already seen.
        self._ids.append(token_id)
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return None
        return full[len(self.text) :] if full.startswith(self.text) else None
