"""A running estimate of how many tokens requests really generate, from finished ones.

A batch of requests with ``max_tokens=1024`` that mostly stop after a few dozen tokens needs
far fewer KV blocks than ``max_tokens`` says. ``OutputLengthEstimator`` keeps, for the last
``window`` finished requests (one engine serves one model, so this is a per-model estimate),
the share of its ``max_tokens`` each one used, and gives their empirical survival function:
for a request that has generated ``g`` of at most ``m`` tokens, the chance it is still
running after ``g + t``. Shares, not absolute lengths, so that requests with different
``max_tokens`` (a job's short answers and another's long ones) inform each other in
proportion: a sample of short answers does not predict that long ones stop early.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

# Finished requests remembered; older ones are forgotten so the estimate follows the workload.
OUTPUT_LENGTH_WINDOW = 1024
# Below this many finished requests the estimate is not trusted (``ready`` is False).
OUTPUT_LENGTH_MIN_SAMPLES = 16
# Shares of max_tokens are looked up on a grid this fine (a table, not a search per lookup).
SHARE_GRID = 4096


class OutputLengthEstimator:
    def __init__(self, window: int = OUTPUT_LENGTH_WINDOW, min_samples: int = OUTPUT_LENGTH_MIN_SAMPLES) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError(f"window and min_samples must be positive, got {window} and {min_samples}")
        self.window = window
        self.min_samples = min_samples
        self._recent: deque[float] = deque()  # arrival order, to forget the oldest
        self._sorted: list[float] = []
        # How many samples exceed each 1/SHARE_GRID step of shares; None: stale.
        self._table: np.ndarray | None = None

    def record(self, num_output_tokens: int, max_output_tokens: int) -> None:
        """A request finished after generating ``num_output_tokens`` of at most ``max_output_tokens``."""
        if not 0 <= num_output_tokens <= max_output_tokens or max_output_tokens < 1:
            raise ValueError(
                f"need 0 <= num_output_tokens <= max_output_tokens and max_output_tokens >= 1, "
                f"got {num_output_tokens} and {max_output_tokens}"
            )
        share = num_output_tokens / max_output_tokens
        self._recent.append(share)
        bisect.insort(self._sorted, share)
        if len(self._recent) > self.window:
            oldest = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._table = None

    @property
    def num_samples(self) -> int:
        return len(self._sorted)

    @property
    def ready(self) -> bool:
        return len(self._sorted) >= self.min_samples

    def num_longer(self, shares: np.ndarray) -> np.ndarray:
        """For each of ``shares``, how many remembered outputs used more of their ``max_tokens``
        (shares are rounded down to ``1 / SHARE_GRID``, which can only count more)."""
        if self._table is None:
            s = np.asarray(self._sorted, dtype=np.float64)
            self._table = len(s) - np.searchsorted(s, np.arange(SHARE_GRID + 1) / SHARE_GRID, side="right")
        return self._table[np.clip((shares * SHARE_GRID).astype(np.int64), 0, SHARE_GRID)]

    def survival(self, generated: np.ndarray, max_output: np.ndarray, horizon: np.ndarray) -> np.ndarray:
        """``[i, j]``: the chance that a request which has generated ``generated[i]`` of at
        most ``max_output[i]`` tokens is still generating after ``horizon[j]`` more (1 for
        one that has gone further than every sample; 0 once at its maximum)."""
        m = max_output[:, None]
        alive_now = self.num_longer(generated / max_output)
        later = self.num_longer((generated[:, None] + horizon[None, :]) / m)
        p = np.where(alive_now[:, None] > 0, later / np.maximum(alive_now, 1)[:, None], 1.0)
        return p * (generated[:, None] + horizon[None, :] < m)
