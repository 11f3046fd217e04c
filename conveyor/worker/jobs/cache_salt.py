"""Whose prefix-cache blocks a job's requests may reuse: the engine's ``cache_salt``.

A cached block is reused only by a request of the same salt, so neither
``usage.prompt_tokens_details.cached_tokens`` nor time to first token tells one tenant
anything about another's prompts. The salt names the job's owner: its API key for an HTTP
batch; for a job submitted without a key (the CLI, a broker producer) the operator's
``CONVEYOR_UNOWNED_CACHE_SALT`` when set, else the job itself. ``CONVEYOR_CACHE_SHARING=global``
turns it off, for a deployment whose every user may see every prompt.
"""

from __future__ import annotations

from conveyor.worker.core.settings import Settings


def cache_salt(settings: Settings, job_id: str, owner: str | None) -> str | None:
    if settings.cache_sharing == "global":
        return None
    if owner is not None:
        return f"owner:{owner}"
    if settings.unowned_cache_salt:
        return f"operator:{settings.unowned_cache_salt}"
    return f"job:{job_id}"
