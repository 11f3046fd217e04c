"""``conveyor run``'s progress bar: requests done, with the rate (req/s and output tok/s) and
the time left measured over the last minute, so neither jumps with each burst of requests
that finish together (many run at once in the engine, and finish in waves).

tqdm draws the bar; the rate and time left are ours (tqdm's own rate is a moving average per
update, and turns into s/req below one request a second). A timer redraws it every second,
so the rate decays while nothing finishes instead of freezing.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from conveyor.worker.core.periodic import Periodic
from conveyor.worker.store.items import ItemRecord

WINDOW_SECONDS = 60.0
REDRAW_SECONDS = 1.0


def duration(seconds: float) -> str:
    """``1:02:03``, ``2:03`` or ``0:07``."""
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class WindowRate:
    """Requests and output tokens per second over the last ``window`` seconds (or since the
    start, when that is later)."""

    def __init__(self, window: float = WINDOW_SECONDS, clock: Any = time.monotonic) -> None:
        self._window, self._clock = window, clock
        self._start = clock()
        self._events: collections.deque[tuple[float, int, int]] = collections.deque()  # (t, requests, tokens)

    def add(self, requests: int, tokens: int) -> None:
        self._events.append((self._clock(), requests, tokens))

    def rates(self) -> tuple[float, float] | None:
        """(req/s, tok/s), or None before a second has passed."""
        t = self._clock()
        while self._events and self._events[0][0] < t - self._window:
            self._events.popleft()
        span = min(self._window, t - self._start)
        if span < 1.0:
            return None
        return sum(e[1] for e in self._events) / span, sum(e[2] for e in self._events) / span


class RunProgress:
    """The bar of one ``conveyor run``: ``start(total, initial)`` once the input is read,
    ``add(records)`` as items are stored (from any thread), ``close()`` at the end."""

    def __init__(self, file: Any = None) -> None:
        self._file = file or sys.stderr
        self._lock = threading.Lock()
        self._bar: Any = None
        self._rate = WindowRate()
        self._timer: Periodic | None = None

    def start(self, total: int, initial: int) -> None:
        with self._lock:
            self._rate = WindowRate()
            self._bar = tqdm(
                total=total, initial=initial, unit="req", desc="conveyor run", file=self._file, dynamic_ncols=True,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} req [{elapsed}{postfix}]",
            )  # fmt: skip
            self._draw()
        self._timer = Periodic("conveyor-run-bar", REDRAW_SECONDS, self.redraw, run_first=False).start()

    def add(self, records: Sequence[ItemRecord]) -> None:
        with self._lock:
            if self._bar is None:
                return
            self._rate.add(len(records), sum(r.completion_tokens for r in records))
            self._bar.update(len(records))
            self._draw()

    def redraw(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._draw()

    def _draw(self) -> None:
        bar = self._bar
        rates = self._rate.rates()
        if rates is None:
            bar.set_postfix_str("", refresh=True)
            return
        per_s, tok_s = rates
        left = bar.total - bar.n
        eta = duration(left / per_s) if per_s > 0 else "?"
        bar.set_postfix_str(f"{per_s:.2f} req/s, {tok_s:.0f} tok/s, ETA {eta}", refresh=True)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
