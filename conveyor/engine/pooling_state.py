"""An embedding request's own state (``Request.pooling``): how it pools, the running sum
of mean pooling, and the vector once its prompt is computed (``conveyor.engine.pooling``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.pooling_config import ResolvedPooling


@dataclass
class PoolingState:
    params: ResolvedPooling
    total: torch.Tensor | None = None  # mean pooling: the sum of the rows so far (float32)
    embedding: list[float] | None = None  # the vector, once the last prompt token is computed
