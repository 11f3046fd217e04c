"""What an embedding request asks for: how the prompt's hidden states become one vector.

``pooling`` is ``last`` (the last token's hidden state: Qwen3-Embedding, gte-Qwen2,
e5-mistral), ``mean`` (the average over the prompt's tokens) or ``cls`` (the first token's);
``normalize`` scales the vector to unit L2 norm; ``dimensions`` keeps its first entries
(Matryoshka truncation, re-normalised when ``normalize``). A field left ``None`` takes the
model's setting (``conveyor.engine.pooling.pooling_config``).

``task="score"`` asks for a relevance score of a text pair instead (``conveyor.engine.pooling.scoring``):
the model's scoring head decides the pooling, so the other fields stay ``None``."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_MODES = ("last", "mean", "cls")
POOLING_TASKS = ("embed", "score")


@dataclass(frozen=True)
class PoolingParams:
    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.task == "score" and (self.pooling, self.normalize, self.dimensions) != (None, None, None):
            raise ValueError("a score request takes no pooling, normalize or dimensions: its head decides them")
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {self.pooling!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
