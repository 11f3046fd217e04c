"""Conveyor: queue-driven batch inference for LLMs.

``from conveyor import LLM, SamplingParams`` is the engine (``conveyor.engine``); ``from conveyor
import Client`` the job client (``conveyor.worker.client``, needs the ``worker`` extra). Both are
imported on first use, so ``import conveyor.worker...`` in a process that serves HTTP or runs
the CLI never pays for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.engine import (
        LLM,
        EmbeddingOutput,
        EngineConfig,
        EngineDeadError,
        LLMEngine,
        PoolingParams,
        RequestMetrics,
        RequestOutput,
        SamplingParams,
        ScoreOutput,
        StartupTimings,
        StructuredOutputs,
    )
    from conveyor.worker.client import Client, JobNotFinished

__all__ = [
    "LLM",
    "Client",
    "EmbeddingOutput",
    "EngineConfig",
    "EngineDeadError",
    "JobNotFinished",
    "LLMEngine",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "ScoreOutput",
    "StartupTimings",
    "StructuredOutputs",
]
# Where each public name lives; the client needs the `worker` extra, the rest only the engine's.
_WHERE = {name: "conveyor.engine" for name in __all__} | {
    "Client": "conveyor.worker.client",
    "JobNotFinished": "conveyor.worker.client",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
