"""The engine's CPU threads, tuned by measuring its own steps: robust to a busy neighbour.

Every torch operator on CPU splits its work over the intra-op threads and waits for the last
of them. When another process keeps one of our CPUs busy, the thread that shares that CPU
runs only when the kernel's scheduler gives it a slice, so every operator of every step
waits for it: on two cores beside one CPU-bound process, a step on two threads measured 3 to
20 times slower than on one (``benchmarks/bench_busy_neighbour.py``). The right count depends
on what else runs, which changes, so it is measured:

- steps run on the current count (``threads``), starting at the budget
  (``conveyor.engine.runner.cpu_threads``: affinity and cgroup quota);
- from time to time a probe compares it with the next count down (or up, alternately) on
  interleaved steps (candidate, current, current, candidate, ...: neighbouring steps carry
  nearly the same batch), by seconds per token scheduled;
- the candidate wins when it is faster by ``MARGIN`` over ``PROBE_PAIRS`` pairs; a single pair
  decides when it shows one more than ``DECISIVE`` times faster than the other (a probe of a
  count that collapses costs one slow step);
- the time between probes doubles each time the current count keeps its place (up to
  ``MAX_PROBE_INTERVAL_S``) and starts again at ``PROBE_INTERVAL_S`` when it changes;
- a step that takes more than ``SURPRISE`` times the median of the recent ones per token (a
  neighbour has just started) brings the next probe forward to the next step.

The engine sets the count on the thread that steps (torch keeps it per thread).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

PROBE_INTERVAL_S = 1.0
MAX_PROBE_INTERVAL_S = 8.0
PROBE_PAIRS = 3
MARGIN = 0.1
DECISIVE = 2.0
SURPRISE = 2.0
RECENT_STEPS = 16  # steps on the current count whose median is its usual cost per token


def thread_ladder(budget: int) -> list[int]:
    """The counts tried: powers of two below the budget, and the budget."""
    ladder = [1]
    while ladder[-1] * 2 < budget:
        ladder.append(ladder[-1] * 2)
    if budget > 1:
        ladder.append(budget)
    return ladder


@dataclass
class _Arm:
    seconds: float = 0.0
    tokens: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    @property
    def per_token(self) -> float:
        return self.seconds / max(1, self.tokens)


@dataclass
class _Probe:
    candidate: int
    steps: int = 0  # steps observed in this probe
    mine: _Arm | None = None
    theirs: _Arm | None = None

    def __post_init__(self) -> None:
        self.mine, self.theirs = _Arm(), _Arm()

    def candidate_turn(self) -> bool:
        """Whether the next step runs on the candidate: C I I C C I ... (each pair's order
        alternates, so a drift in the batch favours neither)."""
        return self.steps % 4 in (0, 3)


class ThreadTuner:
    """Chooses the intra-op thread count for each engine step (see the module docstring)."""

    def __init__(self, budget: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if budget < 2:
            raise ValueError(f"a thread tuner needs a budget of at least 2 threads, got {budget}")
        self.ladder = thread_ladder(budget)
        self.threads = budget
        self._clock = clock
        self._interval = PROBE_INTERVAL_S
        self._next_probe = clock() + self._interval
        self._probe: _Probe | None = None
        self._go_down = True
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.num_probes = 0
        self.num_changes = 0

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def before_step(self) -> int:
        """The thread count for the step about to run."""
        if self._probe is None and self._clock() >= self._next_probe:
            self._probe = _Probe(self._neighbour())
            self.num_probes += 1
        probe = self._probe
        return probe.candidate if probe is not None and probe.candidate_turn() else self.threads

    def after_step(self, seconds: float, tokens: int) -> None:
        """The step just run (on ``before_step``'s count) took ``seconds`` for ``tokens``."""
        if tokens <= 0:
            return
        probe = self._probe
        if probe is None:
            self._watch(seconds / tokens)
            return
        assert probe.mine is not None and probe.theirs is not None
        (probe.theirs if probe.candidate_turn() else probe.mine).add(seconds, tokens)
        probe.steps += 1
        if probe.steps % 2:
            return
        ratio = probe.theirs.per_token / max(probe.mine.per_token, 1e-12)
        if ratio > DECISIVE or ratio * DECISIVE < 1.0:
            self._end_probe(won=ratio < 1.0)
        elif probe.steps >= 2 * PROBE_PAIRS:
            self._end_probe(won=ratio < 1.0 - MARGIN)

    def _watch(self, per_token: float) -> None:
        """Probe at once when the current count suddenly costs far more than it did."""
        recent = self._recent
        if len(recent) >= RECENT_STEPS // 2 and per_token > SURPRISE * statistics.median(recent):
            self._next_probe = self._clock()
            recent.clear()
            return
        recent.append(per_token)

    def _neighbour(self) -> int:
        """The count to try next: one rung down, or up, alternately where both exist."""
        i = self.ladder.index(self.threads)
        down = self.ladder[i - 1] if i > 0 else None
        up = self.ladder[i + 1] if i + 1 < len(self.ladder) else None
        pick = down if (self._go_down and down is not None) or up is None else up
        self._go_down = not self._go_down
        assert pick is not None
        return pick

    def _end_probe(self, *, won: bool) -> None:
        assert self._probe is not None
        if won:
            self.threads = self._probe.candidate
            self.num_changes += 1
            self._interval = PROBE_INTERVAL_S
        else:
            self._interval = min(MAX_PROBE_INTERVAL_S, self._interval * 2)
        self._probe = None
        self._recent.clear()  # a new baseline, on the count now current
        self._next_probe = self._clock() + self._interval
