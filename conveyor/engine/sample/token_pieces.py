"""Each token's own text and bytes, as logprobs report them.

A token's text is what decoding it alone gives. Its bytes are the UTF-8 it stands for, which
is not always that text encoded: a byte-level BPE token can hold part of a character (the
first two bytes of an emoji, say), whose text alone is U+FFFD. For those the bytes come
from the token's vocabulary entry instead: a SentencePiece byte-fallback piece ``<0xE2>``
is that byte, and a byte-level entry is spelled in GPT-2's printable stand-ins for bytes.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"  # SentencePiece's word-start mark


@cache
def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte -> the byte: printable Latin-1
    characters stand for themselves, the others (controls, space, soft hyphen...) are
    shifted past 255 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_in = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in stand_in:
            stand_in[b] = 256 + shifted
            shifted += 1
    return {chr(c): b for b, c in stand_in.items()}


def _uses_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return False
    return '"ByteLevel"' in json.dumps(json.loads(backend.decoder.__getstate__()))


class TokenPieces:
    """Cached text and bytes of single tokens of one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _uses_byte_level(tokenizer)
        self._text: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text_of(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes_of(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            text = self.text_of(token_id)
            raw = self._vocab_bytes(token_id) if REPLACEMENT in text else None
            raw = self._bytes[token_id] = text.encode("utf-8") if raw is None else raw
        return raw

    def _vocab_bytes(self, token_id: int) -> bytes | None:
        """The bytes the vocabulary entry spells, or None when it is not a byte spelling."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if self.byte_level:
            alphabet = byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
            return None
        return piece.replace(_SPACE_MARK, " ").encode("utf-8")
