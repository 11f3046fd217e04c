"""The fewest tokens a text can become, from its length in bytes alone.

No token of the vocabulary covers more input bytes than its own text has (byte-level BPE's
and SentencePiece's symbols, byte-fallback tokens and WordPiece's ``##`` pieces are all at
least as long, in UTF-8, as the bytes they stand for), so a text of ``n`` bytes is at least
``n / longest`` tokens, and an over-long prompt is refused before any tokenising. That holds
only where the tokenizer never deletes input before it matches tokens: a Unicode
normalization can compose a few code points into one (allowed for, with a factor), while
other normalizers (stripping, replacing, BERT's control-character cleaning) and added tokens
that swallow the spaces around them can make any text one token, so there is no bound.
"""

from __future__ import annotations

import json
from typing import Any

# The most these normalizers shrink a text in UTF-8: three Hangul jamo (nine bytes) compose
# into one three-byte syllable; lowercasing the Kelvin sign (three bytes) gives "k" (one).
_SHRINKING = {"NFC": 4, "NFKC": 4, "NFD": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1}


def bytes_per_token_bound(hf_tokenizer: Any) -> int | None:
    """The most input bytes one token can stand for (None: no bound for this tokenizer)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    state = json.loads(backend.to_str())
    factor = _normalizer_factor(state.get("normalizer"))
    if factor is None:
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in state.get("added_tokens") or ()):
        return None
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in hf_tokenizer.get_vocab()), default=0)
    return longest * factor if longest else None


def _normalizer_factor(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or ():
            sub = _normalizer_factor(part)
            if sub is None:
                return None
            factor *= sub
        return factor
    return _SHRINKING.get(kind) if isinstance(kind, str) else None


def min_tokens(text: str, max_bytes_per_token: int | None) -> int:
    """At least this many tokens encode ``text`` (0: unknown)."""
    if not max_bytes_per_token:
        return 0
    size = len(text.encode("utf-8", "surrogatepass"))
    return -(-size // max_bytes_per_token)
