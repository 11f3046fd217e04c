"""The settings of the model cache (weights from an object store)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from conveyor.worker.core.limits import GiB


class ModelCacheSettings(BaseModel):
    """Model cache.

    Weights from an object store (``--model s3://bucket/prefix/``), downloaded once per node.
    """

    # Where s3:// weights are cached; unset: $HF_HOME/conveyor-models when HF_HOME is set, else <home>/models.
    model_cache: Path | None = None
    # A model prefix holding more objects than this is refused before anything is downloaded.
    model_max_files: int = Field(1000, ge=1, le=1_000_000)
    # A model prefix holding more bytes than this is refused before anything is downloaded.
    model_max_bytes: int = Field(1024 * GiB, ge=1)
    # Parallel downloads of a model's files.
    model_download_threads: int = Field(8, ge=1, le=64)
    # How a cached copy is checked at each start: ``sha256`` re-hashes every file, ``size`` compares sizes and times.
    model_cache_verify: Literal["sha256", "size"] = "sha256"
