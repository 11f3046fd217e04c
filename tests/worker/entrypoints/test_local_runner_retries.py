"""``conveyor run`` has no broker to bring a shard back: a shard whose lease was lost (its
heartbeats starved on a loaded machine) or is held elsewhere is tried again here until it is
done, instead of leaving the job ``in_progress``."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.worker.entrypoints import local_runner
from conveyor.worker.execution.shard_runner import ANOTHER_HOLDS_IT, RetryShard, ShardOutcome


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_runner, "RETRY_SECONDS", 0.0)


def _scripted(monkeypatch: pytest.MonkeyPatch, results: list[Any]) -> list[int]:
    calls: list[int] = []

    def run_shard(ctx: Any, job_id: str, index: int) -> ShardOutcome:
        calls.append(index)
        result = results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(local_runner, "run_shard", run_shard)
    return calls


def test_a_lost_lease_or_a_lease_held_elsewhere_runs_the_shard_again(monkeypatch: pytest.MonkeyPatch) -> None:
    done = ShardOutcome("batch_x", 3, "completed", items=4)
    calls = _scripted(
        monkeypatch,
        [
            ShardOutcome("batch_x", 3, "lease_lost", items=1, reason="lease on shard 3 of job batch_x was lost"),
            ShardOutcome("batch_x", 3, "skipped", reason=ANOTHER_HOLDS_IT),
            RetryShard("boom", 1),
            done,
        ],
    )
    assert local_runner._run_with_retries(None, "batch_x", 3) is done  # type: ignore[arg-type]  # run_shard is replaced
    assert calls == [3, 3, 3, 3]


@pytest.mark.parametrize("status, reason", [("skipped", "shard already completed"), ("cancelled", ""), ("failed", "x")])
def test_any_other_outcome_ends_the_shard_at_once(monkeypatch: pytest.MonkeyPatch, status: str, reason: str) -> None:
    outcome = ShardOutcome("batch_x", 0, status, reason=reason)
    calls = _scripted(monkeypatch, [outcome])
    assert local_runner._run_with_retries(None, "batch_x", 0) is outcome  # type: ignore[arg-type]  # as above
    assert calls == [0]
