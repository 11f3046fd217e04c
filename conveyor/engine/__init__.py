"""Conveyor's inference engine: continuous batching over a paged KV cache."""

from conveyor.engine.config import EngineConfig
from conveyor.engine.core.llm_engine import LLMEngine
from conveyor.engine.core.startup import StartupTimings
from conveyor.engine.errors import EngineDeadError
from conveyor.engine.llm import LLM
from conveyor.engine.outputs import EmbeddingOutput, RequestMetrics, RequestOutput, ScoreOutput
from conveyor.engine.pooling.pooling_params import PoolingParams
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured.structured_outputs import StructuredOutputs

__all__ = [
    "LLM",
    "EmbeddingOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "ScoreOutput",
    "StartupTimings",
    "StructuredOutputs",
]
