"""Where a worker process is in its life, as its health endpoints and its shards see it.

``starting`` (checking its configuration, the schema and the store), ``loading`` (the model),
``ready`` (consuming), ``draining`` (told to stop: it takes no new shard, lets running ones
finish until the hand-back time, then hands back what is left), ``stopped``.

Draining has two moments. The *hand-back time* is when running shards stop waiting for
their items: they abort what is still in the engine, store what finished and release their
leases as ``pending``, so another worker resumes them at once. The *deadline*, a margin
later, is when the process should be gone (Kubernetes' grace period covers it). The margin
is what releasing takes: a commit per shard, and one for the finished items.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

# Of the drain timeout, what is kept for handing back and exiting: a fifth, 1 to 10 s.
_MARGIN_SHARE, _MARGIN_MIN, _MARGIN_MAX = 0.2, 1.0, 10.0


class Phase(str, enum.Enum):
    starting = "starting"
    loading = "loading"
    ready = "ready"
    draining = "draining"
    stopped = "stopped"


@dataclass(frozen=True)
class Drain:
    started_at: float  # time.monotonic()
    hand_back_at: float
    deadline: float
    reason: str


class ProcessState:
    """Thread-safe: the Celery main thread, the shard threads and the health server read it.
    (Re-entrant: Celery's stop signal handler may interrupt the main thread inside it.)"""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._phase = Phase.starting
        self._since = time.monotonic()
        self._drain: Drain | None = None
        self._busy = 0  # tasks running now
        self._idle_since = time.monotonic()

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    def advance(self, phase: Phase) -> None:
        """Move on to ``phase``; a draining or stopped process never goes back to ready."""
        with self._lock:
            order = list(Phase)
            if order.index(phase) > order.index(self._phase):
                self._phase, self._since = phase, time.monotonic()

    def begin_drain(self, timeout: float, reason: str) -> Drain:
        """Start draining (the first call decides the deadline; later ones return it)."""
        with self._lock:
            if self._drain is None:
                t = time.monotonic()
                margin = min(_MARGIN_MAX, max(_MARGIN_MIN, timeout * _MARGIN_SHARE), timeout / 2)
                self._drain = Drain(t, t + timeout - margin, t + timeout, reason)
                if self._phase is not Phase.stopped:
                    self._phase, self._since = Phase.draining, t
            return self._drain

    @property
    def drain(self) -> Drain | None:
        with self._lock:
            return self._drain

    @property
    def draining(self) -> bool:
        return self.drain is not None

    def hand_back_due(self) -> bool:
        """Draining, and running shards should hand back what they hold now."""
        drain = self.drain
        return drain is not None and time.monotonic() >= drain.hand_back_at

    def task_started(self) -> None:
        with self._lock:
            self._busy += 1

    def task_finished(self) -> None:
        with self._lock:
            self._busy = max(0, self._busy - 1)
            if self._busy == 0:
                self._idle_since = time.monotonic()

    @property
    def running_tasks(self) -> int:
        with self._lock:
            return self._busy

    def idle_seconds(self) -> float:
        """How long no task has run in this process (0 while one runs); the clock starts at
        ``ready``, so loading the model never counts as idle."""
        with self._lock:
            if self._busy or self._phase is not Phase.ready:
                return 0.0
            return time.monotonic() - max(self._idle_since, self._since)
