"""The settings of prefix-cache sharing."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class CacheSharingSettings(BaseModel):
    """Cache sharing.

    Prefix-cache sharing between jobs and their owners.
    """

    # Prefix-cache sharing between jobs (``conveyor.worker.execution.cache_salt``): ``owner`` reuses cached
    # prompt blocks only between jobs of one owner (an API key), so no tenant learns another's
    # prompts from ``cached_tokens`` or timing; ``global`` shares them between all jobs (only
    # for a deployment whose users may all see each other's prompts).
    cache_sharing: Literal["owner", "global"] = "owner"
    # The prefix-cache owner of every job submitted without an API key (``conveyor submit``, a
    # broker producer), so the operator's own jobs share their cache; empty: each such job alone.
    unowned_cache_salt: str = Field("", max_length=128)
