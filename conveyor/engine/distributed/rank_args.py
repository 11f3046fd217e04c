"""What rank 0 hands each rank it starts: enough to build the same model runner."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from conveyor.engine.config import EngineConfig
from conveyor.engine.models.model_config import ModelSpec

# A collective that waits longer than this fails instead of hanging (a rank that died is
# caught sooner: its sockets close, or rank 0's watcher sees its exit). Generous, because
# the first collective follows loading the weights, which may take minutes on some ranks.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
HOST = "127.0.0.1"


@dataclass(frozen=True)
class RankArgs:
    rank: int
    world_size: int
    port: int  # rank 0's TCP store (0 until rank 0 has opened it)
    backend: str  # nccl or gloo
    config: EngineConfig
    model_spec: ModelSpec
    model_path: Path
    max_model_len: int
    model_impl: str
    cpu_threads: int  # torch threads per rank on CPU (the cores divided between the ranks)
