"""``/v1/models``: the models batches may name (OpenAI's model objects).

These are the deployment's catalog (``conveyor.worker.jobs.catalog``): the models declared in
``CONVEYOR_MODELS`` and those a worker has served, listed whether or not a worker runs now
(a deployment that scales from zero has none while idle). Each id is the name batches use in
``body.model``; ``created`` is when a worker first served it (for a model only declared so
far, when this server started); ``live_workers``, beside OpenAI's fields, is how many
workers serve it now (``ready``, a heartbeat in the last ``CONVEYOR_WORKER_LIVE_SECONDS``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from conveyor.worker.api.auth import Caller
from conveyor.worker.api.errors import not_found
from conveyor.worker.api.services import Services
from conveyor.worker.jobs.catalog import CatalogModel, catalog, lookup

router = APIRouter(prefix="/v1/models", tags=["models"])

OWNED_BY = "conveyor"


def model_object(entry: CatalogModel, started_at: float) -> dict[str, Any]:
    created = entry.first_served_at if entry.first_served_at is not None else started_at
    return {
        "id": entry.model, "object": "model", "created": int(created), "owned_by": OWNED_BY,
        "live_workers": entry.live_workers,
    }  # fmt: skip


@router.get("")
def list_models(_owner: Caller, services: Services) -> dict[str, Any]:
    entries = catalog(services.db, services.settings)
    return {"object": "list", "data": [model_object(m, services.started_at) for m in entries]}


@router.get("/{model_id:path}")
def retrieve_model(model_id: str, _owner: Caller, services: Services) -> dict[str, Any]:
    entry = lookup(services.db, services.settings, model_id)
    if entry is None:
        raise not_found(
            f"The model '{model_id[:256]}' does not exist here: it is neither declared (CONVEYOR_MODELS) nor served "
            "by any worker.",
            param="model",
        )
    return model_object(entry, services.started_at)
