"""The settings of a worker: its model, queues and engine."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import NoDecode

from conveyor.worker.core.catalog import parse_catalog

_QUEUE_PREFIX = re.compile(r"^[A-Za-z0-9_-]{1,24}$")


class WorkerSettings(BaseModel):
    """Worker.

    The model a worker serves, its queues, its engine and the threads around it.
    """

    # The model a worker serves (``conveyor worker --model``): a hub id, a directory or an s3:// prefix.
    model: str | None = None
    # The public name a worker serves its model under (jobs name it; its queue is named from it).
    served_model_name: str | None = None
    # The deployment's catalog: model names served, comma-separated; accepted while no worker runs.
    models: Annotated[tuple[str, ...], NoDecode] = ()
    # The prefix of every queue name: a model's queue is <prefix>-<model slug>.
    queue_prefix: str = "conveyor"
    # Shard tasks a worker runs at once (threads sharing its one engine).
    worker_concurrency: int = Field(4, ge=1, le=256)
    # The most shards of one owner (API key) a worker runs at once while another owner has work
    # for the model. Unset: one less than ``worker_concurrency`` (at least 1), so a place is left
    # for another owner's shard; an owner alone with work uses every place.
    owner_shard_slots: int | None = Field(None, ge=1, le=256)
    # The worker engine's options: ``EngineConfig`` fields as JSON, e.g. '{"max_num_seqs": 128}'.
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # torch's threads in the worker's engine; unset: the CPUs the process may use, tuned on CPU.
    cpu_threads: int | None = Field(None, ge=1, le=1024)
    # Threads that prepare requests for the engine (chat template, tokenising, grammar compile),
    # off its loop and shared between owners fairly.
    input_threads: int = Field(2, ge=1, le=64)
    # A request's grammar (structured outputs) that takes longer to compile fails alone, ``grammar_too_complex``.
    grammar_compile_seconds: float = Field(10.0, gt=0, le=3600)
    # A request's prompt that takes longer to tokenise fails alone, ``prompt_too_long``.
    tokenize_seconds: float = Field(10.0, gt=0, le=3600)

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: Any) -> tuple[str, ...]:
        return parse_catalog(value)

    @field_validator("queue_prefix")
    @classmethod
    def _check_queue_prefix(cls, value: str) -> str:
        if not _QUEUE_PREFIX.match(value):
            raise ValueError(f"CONVEYOR_QUEUE_PREFIX must be 1-24 letters, digits, '_' or '-', got {value!r}")
        return value

    @property
    def shard_slots_per_owner(self) -> int:
        """``owner_shard_slots``, or its default from ``worker_concurrency``."""
        if self.owner_shard_slots is not None:
            return self.owner_shard_slots
        return max(1, self.worker_concurrency - 1)
