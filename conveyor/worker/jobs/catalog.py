"""Which models work may name while no worker runs: the deployment's catalog and its history.

A deployment that scales workers from zero cannot ask whether a worker serves a model now:
none does until work arrives, and work that is refused never wakes one. So a model is
accepted when the deployment declares it (``CONVEYOR_MODELS``, the public names it serves) or
when some worker has served it (the worker registry, ``store/workers.py``, keeps the newest
worker of each model). ``GET /v1/models`` lists exactly these, each with its live workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from conveyor.worker.core.settings import Settings
from conveyor.worker.store.model_cache import canonical_model_uri, is_model_uri
from conveyor.worker.store.workers import served_ever


@dataclass(frozen=True)
class CatalogModel:
    model: str
    live_workers: int  # workers serving it now
    first_served_at: float | None  # when a worker first served it (None: none has yet)


def declared_models(settings: Settings) -> tuple[str, ...]:
    """``CONVEYOR_MODELS`` as jobs record models (``conveyor.worker.jobs.model_names``): an ``s3://``
    URI with one trailing slash, a path normalised, a name as it is."""
    out = []
    for name in settings.models:
        if is_model_uri(name):
            out.append(canonical_model_uri(name))
        elif name.startswith("/"):
            out.append(os.path.normpath(name))
        else:
            out.append(name)
    return tuple(dict.fromkeys(out))


def is_declared(settings: Settings, model: str) -> bool:
    return model in declared_models(settings)


def catalog(db: Engine, settings: Settings) -> list[CatalogModel]:
    """Every model work may name now, by name: the declared ones and those a worker has served."""
    declared = set(declared_models(settings))
    served = {s.model: s for s in served_ever(db, settings.worker_live_seconds)}
    out = []
    for model in sorted(declared | set(served)):
        s = served.get(model)
        out.append(CatalogModel(model, s.live if s else 0, s.first_started_at if s else None))
    return out


def lookup(db: Engine, settings: Settings, model: str) -> CatalogModel | None:
    """``model``'s entry, or None when work for it cannot be accepted (neither declared nor
    ever served: a typo, or a model this deployment never ran)."""
    return next((m for m in catalog(db, settings) if m.model == model), None)


def not_served(model: str) -> str:
    """Why work naming ``model`` is refused: the same words whether or not it names a path on
    this machine, so the answer tells a producer nothing about a worker's files."""
    return (
        f"model {model!r:.200} is not one this deployment serves "
        "(declared in CONVEYOR_MODELS, or served by a worker under that name)"
    )
