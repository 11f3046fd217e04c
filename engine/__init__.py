"""Conveyor's inference engine: continuous batching over a paged KV cache."""

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import EmbeddingOutput, RequestMetrics, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.startup import StartupTimings
from engine.structured_outputs import StructuredOutputs

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
    "StartupTimings",
    "StructuredOutputs",
]
