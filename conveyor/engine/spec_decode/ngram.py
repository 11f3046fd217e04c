"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
request's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``). A match
close to the end proposes a copy that runs on into itself, so a loop of period p proposes k
tokens, not only p."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_proposal(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the longest suffix of
    ``token_ids`` (from ``max_n`` to ``min_n`` tokens long) that occurs earlier; [] if none."""
    length = len(token_ids)
    if k < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length-n-1: every occurrence that ends before the suffix
        # itself begins to repeat, so at least one token follows it.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            return _copy(token_ids, int(hits[-1]) + n, k)
    return []


def _copy(token_ids: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on, running on into the copy itself once it passes
    the end (as a loop continues: after ``... a b a b`` matched one period back, ``a b a b``)."""
    length = len(token_ids)
    out = token_ids[start : start + k]
    while len(out) < k:
        out.append(out[start + len(out) - length])
    return out
