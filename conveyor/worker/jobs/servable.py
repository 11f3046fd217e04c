"""Whether ``conveyor submit`` may make a job for a model: one declared (``CONVEYOR_MODELS``) or
served by a live worker, whenever the deployment has a catalog or some worker is live.

With neither (a fresh setup, workers started later) any model is taken, with a warning: the
"submit first, start workers later" flow. Otherwise a name nobody serves is most likely a
typo, and a job for it would wait forever: the refusal names what is served and the closest.
"""

from __future__ import annotations

import difflib

from sqlalchemy.engine import Engine

from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.catalog import declared_models
from conveyor.worker.store.workers import served_ever


def unserved_refusal(db: Engine, settings: Settings, model: str) -> str | None:
    """Why a job for ``model`` (canonical, as jobs record it) is refused; None if it may run."""
    declared = set(declared_models(settings))
    live = {s.model for s in served_ever(db, settings.worker_live_seconds) if s.live}
    servable = sorted(declared | live)
    if not servable or model in servable:
        return None
    close = difflib.get_close_matches(model, servable, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    shown = ", ".join(servable[:20]) + (", ..." if len(servable) > 20 else "")
    return (
        f"no live worker serves model {model} and CONVEYOR_MODELS does not declare it "
        f"(served or declared: {shown}){hint}"
    )
