"""Per-worker engine snapshots: every few seconds one row of the engine's state."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import insert

from conveyor.worker.execution.context import WorkerContext
from conveyor.worker.store.models import EngineSnapshot, now

IDLE_EVERY = 60.0  # an idle engine is recorded this rarely


@dataclass
class _Last:
    at: float = 0.0
    generated: int = 0
    prompt: int = 0
    written_at: float = 0.0


class SnapshotWriter:
    """``write_once`` inserts an ``engine_snapshots`` row (skipped while the engine is idle
    and unchanged, except once a minute)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._last = _Last()

    def write_once(self) -> bool:
        if not self.ctx.host_started:
            return False
        stats = self.ctx.host().stats()
        engine = stats.engine
        if engine is None:
            return False
        t = time.monotonic()
        last = self._last
        dt = t - last.at if last.at else 0.0
        generated = engine.num_generated_tokens - last.generated
        prompt = engine.num_prompt_tokens_computed - last.prompt
        idle = stats.live_requests == 0 and generated == 0 and prompt == 0
        if idle and last.written_at and t - last.written_at < IDLE_EVERY:
            self._last = _Last(t, engine.num_generated_tokens, engine.num_prompt_tokens_computed, last.written_at)
            return False
        row = {
            "worker_id": self.ctx.worker_id,
            "model": self.ctx.model[:256],
            "created_at": now(),
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "kv_usage": float(engine.kv_usage),
            "prefix_hit_rate": float(engine.prefix_cache_hit_rate),
            "tokens_per_s": generated / dt if dt > 0 else 0.0,
            "prompt_tokens_per_s": prompt / dt if dt > 0 else 0.0,
            "preemptions": engine.num_preemptions,
            "extra": {
                "live_requests": stats.live_requests,
                "submitted": stats.submitted,
                "finished": stats.finished,
                "num_steps": engine.num_steps,
                "avg_tokens_per_step": engine.avg_tokens_per_step,
                "kv_blocks_total": engine.kv_blocks_total,
                "kv_blocks_used": engine.kv_blocks_used,
            },
        }
        with self.ctx.db.begin() as conn:
            conn.execute(insert(EngineSnapshot), [row])
        self._last = _Last(t, engine.num_generated_tokens, engine.num_prompt_tokens_computed, t)
        return True
