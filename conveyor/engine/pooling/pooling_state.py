"""An embedding or score request's own state (``Request.pooling``): how it pools, the running
sum of mean pooling, and the vector (or score) once its prompt is computed
(``conveyor.engine.pooling.pooler``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.engine.pooling.pooling_config import ResolvedPooling


@dataclass
class PoolingState:
    params: ResolvedPooling
    total: torch.Tensor | None = None  # mean pooling: the sum of the rows so far (float32)
    embedding: list[float] | None = None  # the vector, once the last prompt token is computed
    # A score request's head (``conveyor.engine.pooling.scoring``): the step's rows and this request's
    # pooled row in, the score out; and the score once computed.
    scorer: Callable[[Any, list[int]], float] | None = None
    score: float | None = None
