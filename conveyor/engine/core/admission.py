"""Admission control: whether the scheduler may admit one more waiting request.

Orthogonal to the ordering policy (which request is next); selected by
``EngineConfig.admission_policy``:

- ``watermark`` (default): admit while the request's first chunk fits and a small share of
  the blocks (``scheduler.ADMISSION_WATERMARK``) stays free for running requests to grow into.
- ``predicted``: the watermark rule, and also: the KV blocks in use, as predicted over the
  coming steps with the newcomer admitted, must stay within the cache. Each running request
  is predicted to keep growing a token a step while it is likely to still be running, given
  the tokens it has generated so far and the share of their ``max_tokens`` the last requests
  finished on this engine used (``OutputLengthEstimator``), and never past its
  ``max_tokens``; a request that is likely done frees its blocks. The expected occupancy at
  each of ``HORIZON_POINTS`` future steps is the sum of these, with a variance from the
  requests finishing independently; a request is admitted if, with it, the expected
  occupancy plus ``OCCUPANCY_STDDEVS`` standard deviations stays within the cache at every
  one of them. Until ``OUTPUT_LENGTH_MIN_SAMPLES`` requests have finished there is no
  estimate and the watermark rule alone decides. Fewer admissions that outgrow the cache
  mean fewer preemptions (each one recomputes a request from scratch). Blocks shared through
  the prefix cache are counted once now, but their growth is counted per request.
"""

from __future__ import annotations

import numpy as np

from conveyor.engine.core.output_length import OutputLengthEstimator
from conveyor.engine.core.request import Request, RequestStatus
from conveyor.engine.memory.request_memory import RequestMemory

# The future steps at which the expected occupancy is checked, spread evenly up to the
# longest a running request may still grow.
HORIZON_POINTS = 64
# Admit while the expected occupancy plus this many standard deviations fits the cache: the
# expectation alone is exceeded about half the time that admission is tight.
OCCUPANCY_STDDEVS = 1.0


class WatermarkAdmission:
    """Today's rule; the scheduler's watermark reserve does all the work."""

    def start(self, running: list[Request]) -> None:
        """An admission round begins with these requests running (their blocks for this step
        already allocated)."""

    def admits(self, req: Request, num_cached_tokens: int) -> bool:
        return True

    def admitted(self, req: Request) -> None:
        """``req``, the last one ``admits`` was asked about, was admitted."""

    def finished(self, req: Request) -> None:
        """``req`` finished (stopped or at its length) with its output complete."""


class PredictedAdmission(WatermarkAdmission):
    def __init__(self, kv: RequestMemory, estimator: OutputLengthEstimator | None = None) -> None:
        self.kv = kv
        self.estimator = estimator if estimator is not None else OutputLengthEstimator()
        self._horizon: np.ndarray | None = None  # future steps looked at; None: no prediction
        self._occupancy = np.zeros(0)  # expected blocks in use at each of them
        self._variance = np.zeros(0)  # and its variance (requests finishing independently)
        self._pending = (np.zeros(0), np.zeros(0))  # the last newcomer's share of both
        self.num_held_back = 0  # admissions this rule refused

    def expected_blocks(self, reqs: list[Request], horizon: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[i, j]``: the mean and the variance of the blocks ``reqs[i]`` holds ``horizon[j]``
        steps from now (it holds them all if still running, else none)."""
        generated = np.array([len(r.output_token_ids) for r in reqs], dtype=np.int64)
        num_tokens = np.array([r.num_tokens for r in reqs], dtype=np.int64)
        max_output = np.array([r.max_total_tokens - r.num_prompt_tokens for r in reqs], dtype=np.int64)
        alive = self.estimator.survival(generated, np.maximum(max_output, 1), horizon)
        bs = self.kv.block_size
        size = (num_tokens[:, None] + horizon[None, :] + bs - 1) // bs
        return alive * size, alive * (1 - alive) * size * size

    def start(self, running: list[Request]) -> None:
        self._horizon = None
        if not self.estimator.ready or not running:
            return  # a newcomer alone always fits
        longest = max(r.max_total_tokens - r.num_tokens for r in running)
        self._horizon = np.unique(np.linspace(0, max(longest, 0), HORIZON_POINTS).astype(np.int64))
        held = sum(len(self.kv.block_ids(r.seq_id)) for r in running)
        mean, var = self.expected_blocks(running, self._horizon)
        self._occupancy = self.kv.num_used_blocks - held + mean.sum(axis=0)
        self._variance = var.sum(axis=0)

    def admits(self, req: Request, num_cached_tokens: int) -> bool:
        if self._horizon is None:
            return True
        # Past the horizon no running request is left, and the newcomer alone fits.
        mean, var = self.expected_blocks([req], self._horizon)
        self._pending = (mean[0] - num_cached_tokens // self.kv.block_size, var[0])
        occupancy = self._occupancy + self._pending[0]
        spread = np.sqrt(self._variance + self._pending[1])
        if float((occupancy + OCCUPANCY_STDDEVS * spread).max()) <= self.kv.num_blocks:
            return True
        self.num_held_back += 1
        return False

    def admitted(self, req: Request) -> None:
        if self._horizon is not None:
            self._occupancy = self._occupancy + self._pending[0]
            self._variance = self._variance + self._pending[1]

    def finished(self, req: Request) -> None:
        if req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.estimator.record(len(req.output_token_ids), req.max_total_tokens - req.num_prompt_tokens)


ADMISSION_POLICIES = ("watermark", "predicted")


def make_admission(name: str, kv: RequestMemory) -> WatermarkAdmission:
    if name == "watermark":
        return WatermarkAdmission()
    if name == "predicted":
        return PredictedAdmission(kv)
    raise ValueError(f"unknown admission policy {name!r}; expected one of {ADMISSION_POLICIES}")
